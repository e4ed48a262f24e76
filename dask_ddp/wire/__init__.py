"""The wire: frozen values that cross a process boundary, and the rules they obey.

Runs in: every process (the client, the Dask worker, the rank process, the scheduler).
What lives here: the rank plan (:mod:`.plan`), the launch spec (:mod:`.spec`), what one
rank's task carries (:mod:`.task`), the messages between a supervisor and its rank
(:mod:`.messages`), the event batch format with its text and integer rules
(:mod:`.events`), preemption notices and stops (:mod:`.notices`), how a rank ended
(:mod:`.outcome`), the exceptions (:mod:`.errors`) and the pickling of the training call
(:mod:`.pickling`).

May import: :mod:`dask_ddp.config` and the wire's own modules, nothing else of dask_ddp
(``tests/test_wings.py`` holds the rule). Every other wing imports the wire.
"""
