#!/usr/bin/env sh
# A single-node cluster without etcd: cgn-infer serving the bundled SmolLM2 on
# 127.0.0.1:8001 and cgn-router in front of it on http://127.0.0.1:8080/v1.
# Ctrl-C stops both. (The etcd + agent path is `cgn-ctl up`, issues #6/#7.)
set -eu
cd "$(dirname "$0")/.."
BIN=.venv/bin
ROUTER=
"$BIN/cgn-infer" serve --model smollm2 --model-name smollm2 --port 8001 &
ENGINE=$!
trap 'kill $ENGINE $ROUTER 2>/dev/null; wait 2>/dev/null' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
i=0
until "$BIN/python" -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8001/health", timeout=1)' 2>/dev/null; do
    i=$((i + 1))
    if [ "$i" -gt 300 ] || ! kill -0 "$ENGINE" 2>/dev/null; then
        echo "cgn-infer did not become healthy" >&2
        exit 1
    fi
    sleep 0.5
done
"$BIN/cgn-router" serve --config configs/single-node.yaml --port 8080 --admin-port 9091 &
ROUTER=$!
wait $ROUTER
