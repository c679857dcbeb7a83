"""Preparing the data on a disk that fills: the machine's failure (status 1) in one line, as elsewhere."""

import resource
import signal
import subprocess
import sys

import corpus
from programs import ENV, REPO, SHORT, assert_one_line_error
from test_train import TINY

FILE_LIMIT = 12288  # bytes: above the run's record, below the corpus's train.bin, cut part-way as a full disk cuts it


def limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of a signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))


def test_a_write_cut_short_while_the_data_is_prepared_is_the_machines_failure(tmp_path):
    text = corpus.write_corpus(tmp_path / "text.txt")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), *TINY, *SHORT, f"data.text={text}",
                             f"data.root={tmp_path / 'prepared'}", f"hydra.run.dir={tmp_path / 'run'}"],
                            cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300,
                            preexec_fn=limit_file_size)
    assert_one_line_error(result, "train.py", "cannot prepare the data", "File too large", status=1)
