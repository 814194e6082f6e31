"""Test and benchmark support shipped with the package, what a user tests with (nothing in the
library imports it; the CI engine beds, real vLLM and SGLang, live in the checkout's ``beds/``).

* :mod:`.oracle`: the global-head oracle (random caches, expected bytes, byte-exact checks).
* :mod:`.pair`: one prefill and one decode engine in this process (:class:`~.pair.EnginePair`).
* :mod:`.child`: one agent child process (:class:`~.child.AgentChild`'s ``{command: handler}``
  loop) and the parent's handle on it (:class:`~.child.ChildProcess`).
* :mod:`.cluster`: a multi-process prefill/decode cluster, each rank an agent child process.
* :mod:`.seams`: what tests inject that the agent's public API does not take (forged or held-back
  messages, events, lanes); tests observe through ``TransferAgent.debug_state()`` and ``stats``.
* :mod:`.rogue`: a rogue peer next to honest engines.
"""
