"""scripts/check-no-outside-paths.sh: nothing in the repository points at the developers' notes.

Users get the repository and nothing beside it, so a file that cites the developers' `shared`
folder sends them to something they do not have. The guard runs on this repository, and on planted
pointers (each flagged pattern, in a loose file and in a tracked file of a scratch repository) so
that a guard that stopped matching would fail here.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check-no-outside-paths.sh"

# Assembled from pieces so that this file does not trip the guard it tests.
SHARED = "shared"
PLANTED = [
    f"Architecture: `../{SHARED}/DESIGN.md`",
    f"see /work/{SHARED}/reference/vllm.md section 5",
    f"the files are in `{SHARED}/traces/`",
    f"{SHARED}/DESIGN.md says so",
    f"per {SHARED}/STYLE.md",
    "loaded from reference" + "-data/x.csv",
]


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=60, check=False)


def test_repository_points_nowhere_outside() -> None:
    res = run()
    assert res.returncode == 0, f"pointers outside the repository:\n{res.stdout}{res.stderr}"
    assert res.stdout == ""


@pytest.mark.parametrize("line", PLANTED)
def test_a_planted_pointer_is_reported_with_file_and_line(tmp_path: Path, line: str) -> None:
    f = tmp_path / "note.md"
    f.write_text(f"# a note\n\n{line}\nnothing else\n")
    res = run(f)
    assert res.returncode == 1, res.stderr
    assert res.stdout.splitlines() == [f"{f}:3:{line}"]
    assert "docs/reference" in res.stderr  # the message says what to do instead


def test_clean_files_and_look_alikes_pass(tmp_path: Path) -> None:
    f = tmp_path / "ok.py"
    slash = "/"  # built, so that a plain grep of the repository for the folder finds nothing here
    f.write_text("# see docs/reference/vllm.md section 5 and common/data/traces/README.md\n"
                 f"shared_storage_path = '/tmp/kv'  # a shared machine; shared{slash} alone is fine\n"
                 f"reference data, shared references, ./shared{slash}x\n")
    res = run(f)
    assert (res.returncode, res.stdout) == (0, ""), res.stdout + res.stderr


@pytest.mark.skipif(shutil.which("git") is None, reason="git is needed for the repository mode")
def test_repository_mode_checks_tracked_files_only(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=60)
    (repo / "docs" / "a.md").write_text("fine\n")
    subprocess.run([*git, "add", "docs/a.md"], check=True, timeout=60)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True, timeout=60)
    assert run("-C", repo).returncode == 0

    (repo / "docs" / "a.md").write_text(f"fine\n{PLANTED[0]}\n")  # a tracked file, edited
    (repo / "untracked.md").write_text(PLANTED[1] + "\n")  # not tracked: not the repository's
    res = run("-C", repo)
    assert res.returncode == 1, res.stderr
    assert res.stdout.splitlines() == [f"docs/a.md:2:{PLANTED[0]}"]


def test_bad_usage_is_rc_2(tmp_path: Path) -> None:
    assert run(tmp_path / "missing.md").returncode == 2
    assert run("--bogus").returncode == 2
    assert run("-C", tmp_path).returncode == 2  # not a git repository
