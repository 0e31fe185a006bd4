"""EPLB policies: functions ``(weight, num_replicas, num_groups, num_nodes, num_gpus,
*, previous=None, ...)`` returning ``(phy2log, log2phy, logcnt)``; ``default`` (DeepSeek),
``flashlb`` (search for the lowest peak) and ``swift`` (incremental, few moves).
``ascend_eplb.register()`` registers them."""
