"""The text the training tests train on, written by the tests themselves, and the real tiny_shakespeare where
this machine has it.

The corpus is a few KB in tiny_shakespeare's manner that uses each of its 65 characters, so a tiny model starts
at a loss of ln(65) on it as on the real text, and the suite needs neither the network nor ../shared.
"""

import hashlib
import os
import urllib.parse
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The play's opening lines: the sampling and precision tests train their tiny models on these alone.
CITIZENS = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish?

All:
Resolved. resolved.

First Citizen:
First, you know Caius Marcius is chief enemy to the people.
"""
PASSAGE = CITIZENS + """
All:
We know't, we know't.

MENENIUS:
Why, masters, my good friends, mine honest neighbours,
Will you undo yourselves, Volsces? What work's, my countrymen, in hand?

JULIET:
O Romeo, Romeo! wherefore art thou Romeo?
Deny thy father and refuse thy name;
Or, if thou wilt not, be but sworn my love,
And I'll no longer be a Capulet.

ROMEO:
Shall I hear more, or shall I speak at this?

KING RICHARD III:
Now is the winter of our discontent
Made glorious summer by this sun of York;
And all the clouds that lour'd upon our house
In the deep bosom of the ocean buried.

QUEEN ELIZABETH:
Zounds! quoth she; the jaws of Xanthippe were quieter - and $3 dearer & dozen queer jests.

PETRUCHIO:
Go, get you home to Padua, you fragments! Hark you, Juliet: bequeath the quarrel to the vexed Gods.

"""
TEXT = PASSAGE * 10  # about 10 KB: a val split of about 1,000 characters, far longer than the tests' blocks
SHA256 = hashlib.sha256(TEXT.encode("utf-8")).hexdigest()


def write_corpus(path: Path) -> Path:
    """Write the corpus to path, a text file as data.text takes, unless it is there already."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(TEXT, encoding="utf-8")
    return path


def real_input() -> Path | None:
    """The real tiny_shakespeare: where KVGPT_DATA_URL points (CI sets it), else ../shared beside the repository;
    None when neither holds it."""
    url = os.environ.get("KVGPT_DATA_URL", "")
    parts = urllib.parse.urlsplit(url)
    candidates = [Path(urllib.parse.unquote(parts.path))] if parts.scheme == "file" else []
    candidates.append(REPO.parent / "shared/data/tiny_shakespeare/input.txt")
    return next((path for path in candidates if path.is_file()), None)


REAL_INPUT = real_input()
NO_REAL_DATA = "the real tiny_shakespeare is absent (set KVGPT_DATA_URL=file:///.../input.txt, or put it in " \
               "../shared/data/tiny_shakespeare/)"
