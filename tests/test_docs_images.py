"""Every picture the docs show is there, and each picture a benchmark draws says beside it how to draw it again.

A picture in docs/images/ is drawn by a benchmark's --plot: the first line of text after it in the doc names that
command in a code span, `python bench/NAME.py ... --plot docs/images/FILE.png`, and every file there is shown by
some doc. An image elsewhere (a screenshot) need only be there.
"""

import re
from pathlib import Path

import pytest

from corpus import REPO

IMAGE = re.compile(r"!\[[^\]]*\]\(\s*([^)\s]+)[^)]*\)|<img\b[^>]*?\bsrc=[\"']([^\"']+)[\"']", re.S)
COMMAND = re.compile(r"`python (bench/[\w/]+\.py)\b[^`]*?--plot (\S+?)(?:\s[^`]*)?`")
PNG = b"\x89PNG\r\n\x1a\n"


def docs(repo: Path) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def beside(text: str, end: int) -> str:
    """The rest of the image's line and the first line of text after it."""
    rest, *after = text[end:].split("\n")
    return rest + " " + next((line for line in after if line.strip()), "")


def command_problem(repo: Path, image: str, text: str) -> str | None:
    """What is wrong with the command beside the picture `image` (repository-relative), or None."""
    commands = [m for m in COMMAND.finditer(text) if m[2] == image]
    if not commands:
        return f"no `python bench/... --plot {image}` command on the line after it"
    script = repo / commands[0][1]
    if not script.is_file():
        return f"its command runs {commands[0][1]}, which is not there"
    if "--plot" not in script.read_text():
        return f"its command runs {commands[0][1]}, which draws no picture (it has no --plot)"
    return None


def problems(repo: Path) -> list[str]:
    """Each picture a doc names that is missing, not a PNG, or without its command, and each one nobody shows."""
    found, shown = [], set()
    images = (repo / "docs" / "images").resolve()
    for doc in docs(repo):
        text = doc.read_text() if doc.is_file() else ""
        for match in IMAGE.finditer(text):
            name = match[1] or match[2]
            path = (doc.parent / name).resolve()
            where = f"{doc.relative_to(repo)}: {name}"
            if not path.is_file():
                found.append(f"{where} is not there")
                continue
            shown.add(path)
            if path.suffix.lower() == ".png" and not path.read_bytes().startswith(PNG):
                found.append(f"{where} is no PNG file (a pointer, or an empty file?)")
            if path.parent == images and (problem := command_problem(repo, path.relative_to(repo.resolve()).as_posix(),
                                                                        beside(text, match.end()))):
                found.append(f"{where}: {problem}")
    for path in sorted(images.glob("*")) if images.is_dir() else []:
        if path.resolve() not in shown:
            found.append(f"docs/images/{path.name} is shown by no doc: show it with its command, or remove it")
    return found


def test_every_picture_the_docs_show_is_there_with_the_command_that_draws_it():
    assert problems(REPO) == []


GOOD = "![A curve](docs/images/curve.png)\nDrawn by `python bench/draw.py --plot docs/images/curve.png`.\n"
IN_DOCS = "![A curve](images/curve.png)\n\n`python bench/draw.py --seeds 1 2 --plot docs/images/curve.png --quick`\n"


@pytest.mark.parametrize("readme, files, fragment", [
    (GOOD, {}, None),
    ("", {"docs/more.md": IN_DOCS}, None),  # a doc in docs/ names it from there, its command from the repository
    ("![A shot](docs/shot.png)\nno command\n", {"docs/shot.png": "png"}, None),  # outside docs/images/: a screenshot
    ("![A curve](docs/images/gone.png)\n`python bench/draw.py --plot docs/images/gone.png`\n", {},
     "docs/images/gone.png is not there"),
    ('<img src="docs/images/gone.png" alt="">\n', {}, "docs/images/gone.png is not there"),
    ("![A shot](docs/shot.png)\n", {}, "docs/shot.png is not there"),
    ("![A curve](docs/images/curve.png)\n\nSome text, no command.\n", {}, "no `python bench/... --plot"),
    ("![A curve](docs/images/curve.png)\n\n\n`python bench/draw.py --plot docs/images/other.png`\n", {},
     "--plot docs/images/curve.png"),  # a command for another picture
    ("![A curve](docs/images/curve.png)\n\nText.\n\n`python bench/draw.py --plot docs/images/curve.png`\n", {},
     "no `python bench/... --plot"),  # too far away: not beside it
    (GOOD.replace("draw.py", "gone.py"), {}, "runs bench/gone.py, which is not there"),
    (GOOD.replace("draw.py", "table.py"), {}, "bench/table.py, which draws no picture"),
    (GOOD, {"docs/images/curve.png": "not a png"}, "is no PNG file"),
    (GOOD, {"docs/images/orphan.png": "png"}, "docs/images/orphan.png is shown by no doc"),
], ids=["shown", "shown-from-docs", "screenshot", "missing", "missing-html", "missing-screenshot", "no-command",
        "another-pictures-command", "command-too-far", "no-such-bench", "bench-without-plot", "not-a-png", "orphan"])
def test_the_check_finds_each_missing_picture_and_command(tmp_path, readme, files, fragment):
    files = {"bench/draw.py": "parser.add_argument('--plot')\n", "bench/table.py": "print('| a |')\n",
             "docs/images/curve.png": "png", **files}
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(PNG if content == "png" else content.encode())
    (tmp_path / "README.md").write_text(readme)
    if readme and "curve.png" not in readme and "docs/more.md" not in files:
        (tmp_path / "docs/images/curve.png").unlink()  # shown by no doc here
    found = problems(tmp_path)
    if fragment is None:
        assert found == []
    else:
        assert len(found) == 1 and fragment in found[0], found
