"""EPLB policies: functions ``(weight, num_replicas, num_groups, num_nodes, num_gpus)``
returning ``(phy2log, log2phy, logcnt)``; ``ascend_eplb.register()`` registers them."""
