"""`--json` written atomically (a temporary file renamed over the target) only where the
target is a regular file: a pipe or a device is written in place (a rename would replace
/dev/null itself with a regular file when run as root), and a symlink keeps pointing at the
file it names."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

from pagedkv.sim.report import write_doc


def test_a_pipe_is_written_in_place_and_stays_a_pipe(tmp_path: Path) -> None:
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(
        target=lambda: got.append(fifo.read_text(encoding="utf-8")), daemon=True
    )
    reader.start()
    write_doc(fifo, {"a": 1})
    reader.join(timeout=10)
    assert json.loads(got[0]) == {"a": 1}
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # still a pipe, not a regular file
    assert list(tmp_path.iterdir()) == [fifo]  # no temporary file left beside it


def test_a_symlink_keeps_naming_its_file(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("{}", encoding="utf-8")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_doc(link, {"b": 2})
    assert link.is_symlink()
    assert json.loads(real.read_text(encoding="utf-8")) == {"b": 2}


def test_a_regular_file_is_replaced_whole(tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    write_doc(out, {"c": 3})
    write_doc(out, {"c": 4})
    assert json.loads(out.read_text(encoding="utf-8")) == {"c": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]
