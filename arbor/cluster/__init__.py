"""Scale-out RL on Ray: engine-replica and trainer-rank actors, weight sync, replica failure recovery.

Beside ``arbor.cli``: it drives ``arbor.train`` and ``arbor.engine`` and is imported by neither (nor by
``arbor.models``). Nothing here imports Ray at module import time; Ray is the optional dependency
``arbor[ray]``.

- ``config``: ``ClusterConfig`` (the ``cluster.*`` keys) and ``ClusterRLConfig`` = ``RLConfig`` + it.
- ``run``: the driver (``train(cfg)``, ``ClusterRun``): placement groups, actors, waiting, cleanup.
- ``trainer_rank``: a trainer rank actor running the ordinary ``RLTrainer``.
- ``remote_engine``: ``RemoteEngine``, the engine interface the loop uses, over the replicas
  (load balancing by in-flight tokens, re-submission on replica death, weight publishing).
- ``replica``: an engine replica actor (``AsyncLLMEngine``), versioned weights.
- ``manager``: the replica manager actor (replacement with current weights, sync orchestration).
- ``weights``: flat byte buffers and the standalone gloo broadcast group.
- ``placement``: colocated or disaggregated placement groups.
- ``ray_env``: starting or joining Ray (usage stats off, session files under the run folder).
"""
