"""What the conductor knows of the cluster and how it learns it: the internal endpoints that
instances and stores report to, the stores still heard from, hot-block replication, metrics and
the status and cost-model exports. (Not ``mooncake_lite.cluster``, which starts a cluster.)"""
