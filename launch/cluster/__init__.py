"""Running a cluster: local processes (local.py) or Ray actors (ray_cluster.py), emulated edge
links (links.py), certificates for mutual TLS (certs.py), and the in-process driver that runs
the drafter's round protocol without a network (inprocess.py)."""
