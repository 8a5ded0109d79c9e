"""Executes schedules: lanes (threads) per device stream, events, the optimizer path.

- ``engine``: the public :class:`~tinypipe.runtime.engine.Engine`; ``build``: its construction
  steps; ``resources``: what every step uses (:class:`EngineResources`); ``context``: what one
  step owns (:class:`StepContext`).
- ``step``: the runner (a worker per lane, supervision, abort); ``workers``: the persistent lane
  threads; ``signals``: task completion and abort; ``handlers``: what each task kind does (by job:
  ``compute_handlers``, ``transfer_handlers``, ``update_handlers``, on ``handler_base``);
  ``stash_io``: host-stashed activations (host buffers, side-stream writes, read-ahead);
  ``buffers``: pack-boundary row buffers; ``device``: one device's streams, shell and pools.
- ``optim/``: the optimizer path (decisions, host and device AdamW, background leftovers).
- ``inputs``: batch validation; ``checkpoint`` (``checksums``, ``exit_guard``: an exit from
  another thread never leaves a half-written one); ``traffic``: link bytes per step;
  ``observability``: memory report and timelines.
"""
