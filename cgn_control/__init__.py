"""The control plane that cgn-router, cgn-ctl and cgn-operator share.

One copy of what a cluster is and what should run where, whatever drives it:

* `catalog`: a model's spec, validated with field-path errors (`parse_model`,
  `check_catalog`); `store` writes and deletes catalog entries after those checks.
* `placement`: where one replica fits (pure).
* `cluster` and `cluster_reader`: the cluster as etcd describes it at one moment
  (`Snapshot`), validated record by record.
* `reconciler`: desired replicas against actual ones, the actions to close the gap (pure).
* `loop`: the elected leader's loop that reads snapshots and writes the reconciler's
  actions; every router runs it, one leads.
* `views`: what a person or a status field reads of a snapshot (a model's ready replicas).

cgn-router runs `loop`, cgn-ctl reads and writes through `store` and `views`, and
cgn-operator validates CognitoraModel resources with `store` and fills their status from
`views`: a model YAML means the same on bare metal and on Kubernetes.
"""
