"""Data-parallel replicas over ``torch.distributed``: topology, collectives, shard arithmetic,
the start-up consistency check and the watchdog (a heartbeat, and ``links``: a connection between
every two ranks, so a dead peer is seen at once). Nothing here touches a process group at import
time; :func:`tinypipe.distributed.group.replicas_from_environment` builds everything from an
already initialised default group (``torchrun`` + ``init_process_group``)."""
