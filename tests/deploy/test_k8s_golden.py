"""Golden tests: every file ``forge deploy k8s`` writes for each layout, compared with a checked-in copy.

Layouts (``LAYOUTS``): one node (one rank), tp 2 on one node, tp 4 × pp 2 over two nodes (the LLM-API layout),
LoRA (GPT-2 with a PEFT adapter), LLaVA and retrieval (MiniLM on a Milvus server). The copies live in
``tests/deploy/golden/<layout>/``; each also passes the strict validation of ``test_k8s_validation.py``.

Normalised before comparing (they vary between runs and machines, not between outputs): the repository's absolute
path (``<REPO>``) and forge's version (``<VERSION>``). Nothing else varies: the startup budget and ``/dev/shm``
size come from the repository's size in whole GiB, the same for every tiny repository.

To refresh the copies after an intended change, run with ``FORGE_UPDATE_GOLDEN=1`` and review the diff:

    FORGE_UPDATE_GOLDEN=1 python -m pytest tests/deploy/test_k8s_golden.py
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
from pathlib import Path

import pytest

from forge import __version__
from k8s_helpers import deploy, pods_of, read_dir, validate

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("FORGE_UPDATE_GOLDEN") == "1"

LAYOUTS = {
    "one-node": ("tp1", []),
    "tp2-one-node": ("tp2", []),
    "tp4-pp2-two-nodes": ("llmapi-tp4pp2", ["--gpus-per-node", "4", "--image", "registry.example/forge:1"]),
    "lora": ("lora", []),
    "llava": ("llava", []),
    "retrieval": ("retrieval", []),
}


def normalise(text: str, repo: Path) -> str:
    text = text.replace(str(repo), "<REPO>")
    # the version alone, not inside another one (v0.1.0, 10.1.0)
    return re.sub(rf"(?<![\w.]){re.escape(__version__)}(?![\w])", "<VERSION>", text)


def files_of(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_manifests_match_the_golden_copy(layout_repos, tmp_path, layout):
    name, argv = LAYOUTS[layout]
    repo = layout_repos[name]
    out = tmp_path / "k8s"
    assert deploy(repo, out, *argv) == 0
    written = {rel: normalise(text, repo.resolve()) for rel, text in files_of(out).items()}
    golden = GOLDEN / layout
    if UPDATE:
        shutil.rmtree(golden, ignore_errors=True)
        for rel, text in written.items():
            (golden / rel).parent.mkdir(parents=True, exist_ok=True)
            (golden / rel).write_text(text)
    expected = files_of(golden)
    assert sorted(written) == sorted(expected), f"{layout}: files differ (FORGE_UPDATE_GOLDEN=1 rewrites them)"
    for rel, text in expected.items():
        diff = "".join(difflib.unified_diff(text.splitlines(True), written[rel].splitlines(True),
                                            f"golden/{layout}/{rel}", f"written/{rel}"))
        assert not diff, f"{diff}\n(FORGE_UPDATE_GOLDEN=1 rewrites the golden copy)"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_golden_copy_is_valid(layout):
    """What the golden files hold validates strictly (core objects on every minor, custom resources on their CRD)."""
    objects = read_dir(GOLDEN / layout)
    problems = []
    for name, obj in objects.items():
        problems += [f"{name}: {p}" for p in validate(obj)]
        for pod in pods_of(obj):
            problems += [f"{name} (pod): {p}" for p in validate(pod)]
    assert not problems, "\n".join(problems)
