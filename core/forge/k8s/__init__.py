"""``forge deploy k8s``: Kubernetes manifests (or a Helm chart) that run ``forge serve`` on a repository.

One node: a Deployment and a Service. More ranks than ``--gpus-per-node``: a LeaderWorkerSet whose group is the
repository's ranks. ``--kserve``: a KServe ServingRuntime and InferenceService. ``--autoscale hpa|keda``: scaling on
the requests waiting (vLLM's metric name, exported by forge serve's OpenAI API), with a ServiceMonitor.
:mod:`.plan` checks the flags, :mod:`.pods` and :mod:`.objects` build the objects, :mod:`.helm` the chart,
:mod:`.output` the files.
"""

from __future__ import annotations

from pathlib import Path

from .plan import Options, Plan, make_plan

__all__ = ["Options", "Plan", "make_plan", "write"]


def write(repo: Path, out: Path, options: Options, command: str = "forge deploy k8s") -> tuple[Plan, dict[str, str]]:
    """Check everything, render every file, then write the directory ``out`` in one rename."""
    from .output import render, write_tree

    plan = make_plan(repo, options)
    files = render(plan, command)
    write_tree(out, files)
    return plan, files
