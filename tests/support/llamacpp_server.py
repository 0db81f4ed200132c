"""Run llama.cpp's own server in-process through xllamacpp (the reference engine in tests).

python tests/support/llamacpp_server.py MODEL PORT THREADS N_PARALLEL CTX
"""

import signal
import sys
import threading

import xllamacpp

model, port, threads, parallel, ctx = sys.argv[1], *map(int, sys.argv[2:6])
params = xllamacpp.CommonParams()
params.model.path = model
params.port = port
params.hostnames = ["127.0.0.1"]
params.cpuparams.n_threads = threads
params.cpuparams_batch.n_threads = threads
params.n_parallel = parallel
params.n_ctx = ctx * parallel
params.endpoint_metrics = True  # /metrics, as `llama-server --metrics`
server = xllamacpp.Server(params)
done = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: done.set())
done.wait()
