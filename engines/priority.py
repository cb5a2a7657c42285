"""Whether an engine schedules by the request body's ``priority`` field, and in which order, read from
the command line it runs with (what a node agent registers as the endpoint's ``priority_order``).

- vLLM (and the simulator, which takes vLLM's flag): ``--scheduling-policy priority`` (vLLM also reads
  ``--scheduling_policy``: its parser turns underscores in flag names into dashes). The waiting queue
  is ordered by ``(priority, arrival)``, the **lower** value first (``low_first``). Without it the
  field does not order anything (vLLM's V0 engine refused a non-zero one: "Priority scheduling is not
  enabled").
- SGLang: ``--enable-priority-scheduling`` orders by the **higher** value first (``high_first``);
  with ``--schedule-low-priority-values-first`` as well, the lower first (``low_first``). Without
  ``--enable-priority-scheduling`` the field is ignored (refused only with
  ``--abort-on-priority-when-disabled``).
- Other kinds (llama.cpp, TensorRT-LLM, a hosted OpenAI-compatible API): ``None``.

The sources these facts come from are named in ``extproc/flow/README.md`` ("Engines that schedule by
priority").
"""

from __future__ import annotations

from collections.abc import Sequence

#: ``low_first``: a lower ``priority`` value is served earlier (vLLM); ``high_first``: a higher (SGLang's
#: default order).
PRIORITY_ORDERS = ("low_first", "high_first")


def _value(argv: Sequence[str], flag: str, *, underscores: bool = False) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag v`` or ``--flag=v``; the last one wins), else ``None``.
    ``underscores``: ``_`` in a flag's name reads as ``-`` (vLLM's parser accepts ``--scheduling_policy``)."""
    found = None
    for i, arg in enumerate(argv):
        if underscores and arg.startswith("--"):
            name, eq, rest = arg.partition("=")
            arg = name.replace("_", "-") + eq + rest
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg[len(flag) + 1 :]
    return found


def priority_order(kind: str, argv: Sequence[str]) -> str | None:
    """The order in which an engine of ``kind`` started with ``argv`` serves the body's ``priority``
    (one of :data:`PRIORITY_ORDERS`), or ``None`` when it does not schedule by it (module docstring)."""
    if kind in ("vllm", "sim"):
        policy = _value(argv, "--scheduling-policy", underscores=kind == "vllm")
        return "low_first" if policy == "priority" else None
    if kind == "sglang":
        if "--enable-priority-scheduling" not in argv:
            return None
        return "low_first" if "--schedule-low-priority-values-first" in argv else "high_first"
    return None
