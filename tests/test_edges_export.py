"""export.py at its edges: a stop signal at any moment, an OUT that is a link, the working folder or a mount point,
a full disk or a file-size limit, and the umask. Each ends in one line (or a whole export) and leaves nothing
behind."""

import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # through the commands, end to end: python -m pytest -m slow

pytest.importorskip("transformers")  # requirements-dev.txt installs them; kvgpt runs without them
pytest.importorskip("onnxruntime")

from programs import ENV, REPO, assert_one_line_error, child_signal  # noqa: E402
from runtime.checkpoint import build_checkpoint, save_checkpoint  # noqa: E402
import export as export_py  # noqa: E402
from test_export import TRAINED_ON, VOCAB, kvgpt_model, run_export  # noqa: E402

HF_FILES = ["README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"]
ONNX_FILES = ["README.md", "model.onnx", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture
def run(tmp_path) -> Path:
    """A run directory holding a tiny model's best.pt, alone in tmp_path."""
    (tmp_path / "run").mkdir()
    model = kvgpt_model("learned multi-head")
    save_checkpoint(build_checkpoint(model, VOCAB, text=TRAINED_ON), tmp_path / "run" / "best.pt")
    return tmp_path / "run"


def everything(folder: Path) -> list[Path]:
    """Every path under folder, hidden ones too."""
    return sorted(path.relative_to(folder) for path in folder.rglob("*"))


def export_with(hook: str, *argv, cwd: Path, preexec_fn=None, **popen) -> subprocess.Popen:
    """export.py run as a user runs it, once the Python code hook has changed one of its steps."""
    script = f"""
import os, runpy, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
{hook}
sys.argv = ["export.py", *{[str(a) for a in argv]!r}]
runpy.run_path({str(REPO / "export.py")!r}, run_name="__main__")
"""
    return subprocess.Popen([sys.executable, "-c", script], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn, **popen)


def finished(process: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


# the moment a stop signal comes (SIG: the signal): code that raises it there
IMPORTING = """
class Finder:  # the signal comes as a module is first imported
    def find_spec(self, name, path, target=None):
        if name == {module!r}:
            signal.raise_signal(SIG)
sys.meta_path.insert(0, Finder())
"""
STEP = """
import {module} as module
step, calls = module.{name}, []
def signalled(*args, **kwargs):  # the signal comes as the step is first called
    calls.append(args)
    for _ in range({times} if len(calls) == 1 else 0):
        signal.raise_signal(SIG)
    return step(*args, **kwargs)
module.{name} = signalled
"""
MOMENTS = {
    "as export.py's modules load": IMPORTING.format(module="exporting"),
    "as the checkpoint loads": STEP.format(module="exporting.folder", name="load_model", times=1),
    "as transformers loads": IMPORTING.format(module="transformers"),
    "as the weights are written": STEP.format(module="safetensors.torch", name="save", times=1),
    "as the onnx graph is traced": STEP.format(module="exporting.onnx", name="Decoder.forward", times=1),
    "twice as the onnx graph is traced": STEP.format(module="exporting.onnx", name="Decoder.forward", times=2),
    "as a destructor runs in the tracer": """
import exporting.onnx as module
forward = module.Decoder.forward
class Dropped:  # an object of a library's, which Python drops: its __del__ cannot raise
    def __del__(self):
        signal.raise_signal(SIG)
def dropping(*args):
    Dropped()
    return forward(*args)
module.Decoder.forward = dropping
""",
    "as the tokenizer is written": STEP.format(module="exporting.folder", name="write_tokenizer", times=1),
}


@pytest.mark.parametrize("moment, fmt, stop_signal, out", [
    ("as export.py's modules load", "hf", "SIGINT", "new"),
    ("as export.py's modules load", "hf", "SIGHUP", "new"),
    ("as the checkpoint loads", "hf", "SIGTERM", "new"),
    ("as transformers loads", "hf", "SIGTERM", "new"),
    ("as the weights are written", "hf", "SIGTERM", "new"),
    ("as the onnx graph is traced", "onnx", "SIGTERM", "new"),
    ("as a destructor runs in the tracer", "onnx", "SIGINT", "new"),
    ("twice as the onnx graph is traced", "onnx", "SIGTERM", "new"),
    ("as the tokenizer is written", "onnx", "SIGTERM", "empty"),
])
def test_a_stop_signal_at_any_moment_stops_the_export_and_leaves_nothing(run, moment, fmt, stop_signal, out):
    """Ctrl-C (130), SIGHUP (129) or SIGTERM (143): one line, and the folder holds what it held, no hidden partial
    folder in it, whatever a library does with the interrupt: Python drops one raised in a destructor, and a second
    signal interrupts torch's tracer in its middle."""
    folder = run.parent
    if out == "empty":
        (folder / "out").mkdir()
    before = everything(folder)
    hook = MOMENTS[moment].replace("SIG)", f"signal.{stop_signal})")
    result = finished(export_with(hook, "--checkpoint", run, folder / "out", "--format", fmt, cwd=folder,
                                  preexec_fn=child_signal(signal.Signals[stop_signal])))
    assert_one_line_error(result, "export.py", "interrupted", status=128 + signal.Signals[stop_signal])
    assert result.stdout == "" and everything(folder) == before


def test_a_signal_once_the_folder_is_whole_lets_the_export_end(run):
    """As train.py after its final save: the signal is noted, and the whole export stays with status 0."""
    hook = STEP.format(module="exporting.folder", name="put_in_place", times=2).replace("SIG)", "signal.SIGINT)")
    result = finished(export_with(hook, "--checkpoint", run, run.parent / "out", cwd=run.parent))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert sorted(p.name for p in (run.parent / "out").iterdir()) == HF_FILES


def test_a_kill_from_outside_during_a_slow_step_stops_the_export_after_it(run):
    """SIGTERM sent by another process, as `kill` sends it, while the tokenizer is written slowly."""
    hook = """
import exporting.folder as module
step = module.write_tokenizer
def slowly(*args):
    print("writing", flush=True)
    time.sleep(1)
    return step(*args)
module.write_tokenizer = slowly
"""
    before = everything(run.parent)
    process = export_with(hook, "--checkpoint", run, run.parent / "out", cwd=run.parent)
    assert process.stdout.readline() == "writing\n", finished(process).stderr
    process.send_signal(signal.SIGTERM)
    result = finished(process)
    assert_one_line_error(result, "export.py", "interrupted", status=143)
    assert everything(run.parent) == before


def exported(capsys, run: Path, out, *argv) -> list[str]:
    """export.py's main in this process, into out: the names of the files there after a clean exit."""
    export_py.main(["--checkpoint", str(run), str(out), *argv])
    assert capsys.readouterr().err == ""
    return sorted(path.name for path in Path(out).iterdir())


@pytest.fixture
def mount(tmp_path):
    """mount(size): an empty folder on which a tmpfs of that size is mounted, where root may; unmounted after."""
    mounted = []

    def mount_tmpfs(size: str) -> Path:
        folder = tmp_path / "mounted"
        folder.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                               capture_output=True).returncode != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(folder)
        assert os.path.ismount(folder)
        return folder

    yield mount_tmpfs
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_link_to_an_empty_folder_or_to_none_yet_exports_where_it_leads(run, capsys):
    """The link stays, and leads to the export."""
    folder = run.parent
    (folder / "empty").mkdir()
    (folder / "to-empty").symlink_to("empty")
    (folder / "dangling").symlink_to("made/here")
    (folder / "made").mkdir()
    assert exported(capsys, run, folder / "to-empty") == HF_FILES
    assert exported(capsys, run, folder / "dangling", "--format", "onnx") == ONNX_FILES
    assert (folder / "to-empty").is_symlink() and (folder / "dangling").is_symlink()
    assert sorted(p.name for p in (folder / "empty").iterdir()) == HF_FILES
    assert everything(folder / "made") == [Path("here"), *(Path("here") / name for name in ONNX_FILES)]


def test_the_working_folder_empty_is_exported_into(run, capsys, monkeypatch, tmp_path):
    """`.`, `./` and a path ending in `/.`: the folder stays (a shell may stand in it), and the files go in it."""
    for i, out in enumerate([".", "./", "here/."]):
        (tmp_path / f"work{i}" / "here").mkdir(parents=True)
        monkeypatch.chdir(tmp_path / f"work{i}" / ("" if out == "here/." else "here"))
        assert exported(capsys, run, out, "--format", "onnx") == ONNX_FILES
        assert everything(tmp_path / f"work{i}") == [Path("here"), *(Path("here") / name for name in ONNX_FILES)]


def test_an_empty_mount_point_is_exported_into(run, capsys, mount):
    """It cannot be replaced (a fresh disk mounted there, say): the files go in it."""
    mount_point = mount("1m")
    assert exported(capsys, run, mount_point) == HF_FILES
    assert os.path.ismount(mount_point) and sorted(p.name for p in run.parent.iterdir()) == ["mounted", "run"]


@pytest.mark.parametrize("out, fragment", [
    ("loop", "(Too many levels of symbolic links); pass a new or empty folder"),
    ("a-file/out", "a-file is a file, not a folder; create the folder first or export elsewhere"),
    ("n" * 256, "(File name too long); pass a new or empty folder"),
])
def test_an_out_that_cannot_be_a_folder_is_refused_before_anything_is_written(run, capsys, out, fragment):
    """A link that leads back to itself, a path under a file, a name longer than the file system takes: status 2,
    not an error of the disk once the export is written."""
    folder = run.parent
    (folder / "loop").symlink_to("loop")
    (folder / "a-file").write_text("a file\n")
    before = everything(folder)
    status, err = run_export(capsys, "--checkpoint", run, folder / out)
    assert status == 2 and err.count("\n") == 1 and err.startswith("export.py: error: ") and fragment in err, err
    assert everything(folder) == before


def test_a_name_as_long_as_the_file_system_takes_is_exported(run, capsys):
    """The temporary folder's name, beside it, has more than its 255 characters: it stays within the limit."""
    assert exported(capsys, run, run.parent / ("n" * 255)) == HF_FILES
    assert sorted(p.name for p in run.parent.iterdir()) == ["n" * 255, "run"]


def file_size_limit(limit: int):
    """A preexec_fn: the child may write no file larger than limit bytes (Python then gets EFBIG, not SIGXFSZ)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize("fmt", ["hf", "onnx"])
def test_a_file_size_limit_is_one_line_and_leaves_nothing(run, fmt):
    """The weights (60 KB, 110 KB) pass the limit, the tokenizer does not: status 1, no traceback."""
    before = everything(run.parent)
    result = finished(export_with("", "--checkpoint", run, run.parent / "out", "--format", fmt, cwd=run.parent,
                                  preexec_fn=file_size_limit(20_000)))
    assert_one_line_error(result, "export.py", "cannot export to", "(File too large", "nothing was left there",
                          status=1)
    assert everything(run.parent) == before


@pytest.mark.parametrize("fmt", ["hf", "onnx"])
def test_a_full_disk_is_one_line_and_leaves_the_folder_empty(run, capsys, monkeypatch, mount, fmt):
    """A real full disk: a 48 KiB tmpfs, too small for the weights."""
    mount_point = mount("48k")
    monkeypatch.setattr("runtime.command.silence", lambda stream: None)  # capsys' stdout has no file to point away
    status, err = run_export(capsys, "--checkpoint", run, mount_point, "--format", fmt)
    assert status == 1 and err.count("\n") == 1 and "(No space left on device" in err, err
    assert list(mount_point.iterdir()) == []


def test_the_weights_on_a_full_disk_are_one_line(run, capsys, monkeypatch):
    """model.safetensors meets ENOSPC as it is written, without root to mount a small disk."""
    write_bytes = Path.write_bytes

    def full(path, data):
        if path.name == "model.safetensors":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    monkeypatch.setattr("runtime.command.silence", lambda stream: None)
    status, err = run_export(capsys, "--checkpoint", run, run.parent / "out")
    assert status == 1 and err.count("\n") == 1 and "(No space left on device" in err, err
    assert sorted(p.name for p in run.parent.iterdir()) == ["run"]


def test_the_export_leaves_the_umask_alone_and_its_files_follow_it(run):
    """Reading the umask means setting it, which races with any thread that makes a file meanwhile: os.umask is
    never called. The folder and its files get the umask's modes, as any new ones."""
    hook = """
def umask(*args):
    raise AssertionError("os.umask called")
os.umask = umask
"""
    result = finished(export_with(hook, "--checkpoint", run, run.parent / "out", cwd=run.parent,
                                  preexec_fn=lambda: os.umask(0o027)))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert (run.parent / "out").stat().st_mode & 0o777 == 0o750
    assert {path.stat().st_mode & 0o777 for path in (run.parent / "out").iterdir()} == {0o640}
