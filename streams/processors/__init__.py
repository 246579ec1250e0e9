"""Stream processors: validate → assemble → split → dedup → window.

Every stage is a pure core over plain records (``validate``, ``assemble``, ``split``,
``dedup``, ``window``; chained in-process by ``pipeline``) wrapped by thin faust agents
in ``app``. See ``app`` for the delivery guarantee and ``cli`` for the commands.
"""
