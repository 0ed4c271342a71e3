"""``ddpkit train``: the run's top (``trainer``: run, train, start) and one room per concern: ``config``
(``TrainConfig``, the command's flags, and every check before a process starts), ``lr_schedule``, ``state`` (what the
rooms hand each other), ``resume``, ``records`` (``metrics.jsonl`` and what the run says), ``replicas``
(``--replica-groups``) and ``loop`` (the steps of each epoch). docs/architecture.md says why the lines run where they
do. (``ddpkit.app.config`` is the table of every command's options; ``config`` here is the train command's own.)
"""
