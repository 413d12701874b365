"""Links are inputs (issue 51 §1): the checkpoint idiom ``checkpoints/latest -> step_N``, re-pointed after a save.

Each case records and confirms, re-points a link (or re-points the model file that is one), then compares what
lowercache serves (``lower``, ``build``, ``run``'s replay) with a fresh run in a new process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import replay
from tests.helpers.direct import explain, fresh, lower, served, tiny_project, until_served


# A miss goes through the worker's warm server (tests/process/conftest.py), as a user's does by default.
pytestmark = pytest.mark.usefixtures("through_server")

# Where a factory finds the latest checkpoint, three ways; ``{ckpt}`` is the link, relative to the project.
FINDS = {
    "realpath": 'os.path.realpath("{ckpt}") + "/w.pt"',
    "resolve": 'str(Path("{ckpt}").resolve() / "w.pt")',
    "readlink": 'os.path.join(os.path.dirname("{ckpt}"), os.readlink("{ckpt}"), "w.pt")',
}
CHECKPOINTED = '''
import os
from pathlib import Path
import torch


def model():
    net = torch.nn.Linear(8, 4)
    net.load_state_dict(torch.load({find}, weights_only=True))
    torch.manual_seed(0)
    return net.eval(), (torch.randn(1, 8),)
'''


def save_steps(runs: Path, steps: int = 2) -> None:
    """What a training script leaves: one directory per saved step, each with its weights."""
    for step in range(1, steps + 1):
        (runs / f"step_{step}").mkdir(parents=True, exist_ok=True)
        torch.manual_seed(step)
        torch.save(torch.nn.Linear(8, 4).state_dict(), runs / f"step_{step}" / "w.pt")


def point(link: Path, target: str) -> None:
    """``ln -sfn target link``: a new link renamed over the old one, as a training script re-points ``latest``."""
    link.parent.mkdir(parents=True, exist_ok=True)
    temporary = link.with_name(link.name + ".new")
    os.symlink(target, temporary)
    os.replace(temporary, link)


@pytest.mark.parametrize("find, where", [("realpath", "inside"), ("resolve", "outside"), ("readlink", "outside")])
def test_a_repointed_checkpoint_link_is_lowered_afresh(tmp_path, find, where):
    """``checkpoints/latest`` moved from step 1 to step 2 after a save: the next ``lower`` has step 2's weights. Inside
    the project and outside it (``../runs``, where no sweep looks), through realpath, ``Path.resolve()`` and readlink."""
    ckpt = "checkpoints/latest" if where == "inside" else "../runs/latest"
    project = tiny_project(tmp_path / "proj", CHECKPOINTED.format(find=FINDS[find].format(ckpt=ckpt)))
    runs = (project / ckpt).parent
    save_steps(runs)
    point(project / ckpt, "step_1")
    time.sleep(0.1)
    cache = tmp_path / "cache"
    step_1 = until_served(project, cache)
    assert step_1 == fresh(project, tmp_path)

    point(project / ckpt, "step_2")
    manifest, pte, _ = lower(project, cache)
    assert not served(manifest) and "latest" in explain(project, cache)
    assert pte == fresh(project, tmp_path) and pte != step_1


def test_a_model_file_that_is_a_link_is_swept_beside_its_target_and_is_an_input(tmp_path):
    """``model.py -> ../shared/model.py``, whose factory reads a data file beside its target in native code (unheard):
    that file is swept, and re-pointing the link to an identical model beside other data misses too."""
    model = '''
    import os
    import torch


    def model():
        here = os.path.dirname(os.path.realpath(__file__))
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 4)
        with torch.no_grad():
            net.bias.copy_(torch.from_file(os.path.join(here, "bias.f32"), size=4, dtype=torch.float32))
        return net.eval(), (torch.randn(1, 8),)
    '''
    for name, seed in (("shared", 1), ("other", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.py").write_text(textwrap.dedent(model))
        torch.manual_seed(seed)
        (tmp_path / name / "bias.f32").write_bytes(torch.randn(4).numpy().tobytes())
    project = tmp_path / "proj"
    (project / ".git").mkdir(parents=True)
    point(project / "model.py", "../shared/model.py")
    time.sleep(0.1)
    cache = tmp_path / "cache"
    first = until_served(project, cache)

    torch.manual_seed(3)
    (tmp_path / "shared" / "bias.f32").write_bytes(torch.randn(4).numpy().tobytes())
    manifest, pte, _ = lower(project, cache)
    assert not served(manifest) and "bias.f32" in explain(project, cache)
    edited = fresh(project, tmp_path)
    assert pte == edited and pte != first
    lower(project, cache)  # confirms the new record

    point(project / "model.py", "../other/model.py")
    manifest, pte, _ = lower(project, cache)
    assert not served(manifest) and "model.py" in explain(project, cache)
    assert pte == fresh(project, tmp_path) and pte != edited


def build(root: Path, cache: Path) -> dict:
    """``lowercache build`` of the project's one pair; that pair's row of the build report."""
    env = {**os.environ, "LOWERCACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-m", "lowercache.cli", "build"], capture_output=True, text=True, cwd=root, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads((root / "build" / "build-report.json").read_text())["pairs"]
    return row


def test_build_lowers_a_repointed_checkpoint_afresh(tmp_path):
    project = tiny_project(tmp_path / "proj", CHECKPOINTED.format(find=FINDS["realpath"].format(ckpt="checkpoints/latest")))
    (project / "lowercache.toml").write_text('targets = ["tosa-fp"]\n[models.net]\nmodel = "model.py:model"\n')
    save_steps(project / "checkpoints")
    point(project / "checkpoints" / "latest", "step_1")
    time.sleep(0.1)
    cache = tmp_path / "cache"
    built = project / "build" / "net" / "tosa-fp" / "model.pte"
    for _ in range(4):  # recorded, confirmed, then a direct hit
        row = build(project, cache)
        if row["how"] == "direct":
            break
    assert row["how"] == "direct", explain(project, cache)
    step_1 = built.read_bytes()

    point(project / "checkpoints" / "latest", "step_2")
    row = build(project, cache)
    assert row["how"] == "worker" and row["outcome"] == "miss", row
    assert built.read_bytes() == fresh(project, tmp_path) != step_1


# -- lowercache run: what a script sees of a link --------------------------------------------------------------

SEES = {
    "realpath": "open(os.path.join(os.path.realpath(LINK), 'w.txt')).read()",
    "resolve": "(Path(LINK).resolve() / 'w.txt').read_text()",
    "readlink": "os.readlink(LINK)",
    "path-readlink": "str(Path(LINK).readlink())",
    "islink": "str(os.path.islink(LINK))",
    "is_symlink": "str(Path(LINK).is_symlink())",
    "scandir": "str(sorted((e.name, e.is_symlink()) for e in os.scandir(os.path.dirname(LINK))))",
}


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("sees", sorted(SEES))
def test_run_replays_what_a_script_saw_of_a_link(tmp_path, cache_dir, sees, where):
    """A script that writes what it saw of ``latest`` (its text, whether it is a link, what it resolves to): replayed
    while the link stays, run again (and equal to plain ``python``) once it is re-pointed or replaced by a directory."""
    link = "checkpoints/latest" if where == "inside" else "../runs/latest"
    script = f"import os\nfrom pathlib import Path\nLINK = {link!r}\nopen('out.txt', 'w').write({SEES[sees]})\n"
    project = replay.project(tmp_path, script)
    runs = (project / link).parent
    for step in (1, 2):
        (runs / f"step_{step}").mkdir(parents=True)
        (runs / f"step_{step}" / "w.txt").write_text(f"weights of step {step}")
    point(project / link, "step_1")
    time.sleep(0.1)
    replay.replayed(project, cache_dir)
    point(project / link, "step_2")
    explained = replay.same_as_plain(project, cache_dir)
    assert "latest" in explained
    if sees in ("islink", "is_symlink", "scandir"):  # the same link text, but no longer a link
        replay.replayed(project, cache_dir)
        os.unlink(project / link)
        (project / link).mkdir()
        (project / link / "w.txt").write_text("weights of step 2")
        explained = replay.same_as_plain(project, cache_dir)
        assert "latest" in explained or "checkpoints" in explained or "runs" in explained, explained

