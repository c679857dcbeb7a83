"""How sample.py writes what the model generates: samples as they grow, the lines of a file continued side by
side, and the interactive loop, whose conversation a session file takes up and keeps."""

import contextlib
import itertools
import signal
import sys
from pathlib import Path

import torch

from data import CharVocab
from model import GPT, Sampling
from model.serving.conversation import Conversation
from model.serving.engine import Engine
from runtime.errors import Interrupted, UsageError
from runtime.files import Locked, locked
from runtime.signals import StopSignals, hung_up
from .options import encode_prompt
from .session import SessionError, load_session, save_session

SAMPLE_SEPARATOR = "---------------\n"
EACH_LINE_BATCH, BLOCK_TOKENS = 16, 16  # --each-line: lines decoded at once, and tokens per block of the pool
REPLY_STOP = "\n\n"  # --interactive: a reply ends with a blank line (a speech's end, in a play)


def checked(steps):
    """generate_tokens checks its arguments when asked for its first token: ask now, so that a mistake is
    reported before anything is written. Its messages name the argument, as the options do."""
    try:
        first = next(steps, None)
    except ValueError as e:
        raise UsageError(e) from None
    return steps if first is None else itertools.chain([first], steps)


def write_samples(steps, prompt: str, vocab: CharVocab, num_samples: int, out, every: int) -> None:
    """Write the samples as they are generated: a lone one as it grows, its tokens read back from the device
    every `every` steps; samples generated side by side, one after another at the end. A stop signal stops the
    generation between two steps; what it had generated is written (a second signal cannot stop that), then
    Interrupted is raised."""
    texts, pending = [prompt] * num_samples, []  # text not yet written; the newest tokens, still on the device

    def read_back():
        rows = torch.stack(pending, dim=1).tolist() if pending else [[]] * num_samples
        pending.clear()
        return [text + vocab.decode(row) for text, row in zip(texts, rows)]

    with stops_set_flag() as stopped:
        for next_ids in steps:
            pending.append(next_ids)
            if num_samples == 1 and len(pending) == every:
                out.write(read_back()[0])
                out.flush()
                texts = [""]
            if stopped.is_set():
                break
        out.write(SAMPLE_SEPARATOR.join(text + "\n" for text in read_back()))
        out.flush()
    if stopped.is_set():
        raise stopped.interrupted()


def continue_lines(model: GPT, vocab: CharVocab, text: str, max_new_tokens: int, sampling: Sampling,
                   generator: torch.Generator, out, buckets: bool | None = None) -> tuple[Engine, int]:
    """--each-line: each line of text with characters in it, with its newline (where the vocabulary has one),
    continued by max_new_tokens tokens (its last block_size - max_new_tokens are read), the lines decoded together.
    Each is written as soon as it and those before it are done. buckets: as Engine takes it (on CUDA by default,
    each bucket's step captured)."""
    block = model.config.block_size
    newline = "\n" if "\n" in vocab.chars else ""  # a text with no newline is continued on the line
    lines = [line + newline for line in text.splitlines() if line.strip()]
    engine = Engine(model, n_blocks=EACH_LINE_BATCH * -(-block // BLOCK_TOKENS), block_tokens=BLOCK_TOKENS,
                    max_batch=EACH_LINE_BATCH, sampling=sampling, generator=generator, buckets=buckets)
    requests = [engine.add(i, vocab.encode(line)[-(block - max_new_tokens):], max_new_tokens)
                for i, line in enumerate(lines)]
    in_order = LinesInOrder(lines, requests, vocab, out)
    with stops_set_flag() as stopped:  # a stop: the lines begun are written as far as they got
        for _ in engine.run():
            in_order.write_while(lambda request: request.drawn == max_new_tokens)
            if stopped.is_set():
                in_order.write_while(lambda request: request.drawn > 0)
                raise stopped.interrupted()
    return engine, len(lines)


class LinesInOrder:
    """--each-line's output: each line of the file, in the file's order, with what it has drawn, written once."""

    def __init__(self, lines: list[str], requests: list, vocab: CharVocab, out):
        self.lines, self.requests, self.vocab, self.out = lines, requests, vocab, out
        self.count = 0  # lines[:count] are written

    def write_while(self, ready) -> None:
        """Write the next lines while ready(the next one's request) says it is ready."""
        while self.count < len(self.lines) and ready(self.requests[self.count]):
            request = self.requests[self.count]
            continuation = self.vocab.decode(request.tokens[request.prompt_len:])
            self.out.write((SAMPLE_SEPARATOR if self.count else "") + self.lines[self.count] + continuation + "\n")
            self.out.flush()
            self.count += 1


def ends_session(signal_name: str | None) -> bool:
    """--interactive's rule: Ctrl-C ends a reply, or drops the line being typed; SIGTERM or SIGHUP ends the session."""
    return signal_name not in (None, "SIGINT")


class StopFlag:
    """Which stop signal came, if any: a signal that ends the command (SIGTERM, SIGHUP) outranks Ctrl-C."""

    def __init__(self):
        self.signal_name = None

    def is_set(self) -> bool:
        return self.signal_name is not None

    def note(self, signum, frame) -> None:
        hung_up(signum)
        if self.signal_name in (None, "SIGINT"):
            self.signal_name = signal.Signals(signum).name

    def ends_command(self) -> bool:
        """Whether a signal came that ends even --interactive's session (ends_session)."""
        return ends_session(self.signal_name)

    def interrupted(self) -> Interrupted:
        return Interrupted(self.signal_name)


@contextlib.contextmanager
def stops_set_flag():
    """While inside, a stop signal (Ctrl-C, SIGTERM, SIGHUP) sets the flag yielded instead of interrupting: sampling
    or a reply then ends between two tokens, with the text whole, and a second signal cannot stop what the first
    keeps."""
    flag = StopFlag()
    previous = {sig: signal.signal(sig, flag.note) for sig in StopSignals.SIGNALS}
    try:
        yield flag
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def interact(conversation: Conversation, vocab: CharVocab, max_new_tokens: int, out) -> None:
    """Show the conversation's text so far (the prompt, or a session's text), then read lines from standard input
    to its end (Ctrl-D). Each line, with its newline, is added to the text and the model continues it, written as
    it is drawn, up to max_new_tokens characters or through REPLY_STOP. Ctrl-C ends a reply (while typing: the
    line); SIGTERM or SIGHUP ends the session, after the token being drawn. A line with characters outside the
    vocabulary is one line on stderr, and the loop goes on."""
    newline = "\n" if "\n" in vocab.chars else ""
    stop = vocab.encode(REPLY_STOP) if set(REPLY_STOP) <= set(vocab.chars) else ()
    print(f"type a line and press Enter: the model continues the text for up to {max_new_tokens} characters"
          f"{' or to a blank line' if stop else ''}. Ctrl-C ends a reply, Ctrl-D the session.", file=sys.stderr)
    out.write(vocab.decode(conversation.tokens))
    out.flush()
    while True:
        try:
            line = input()
            line.encode()  # bytes that are not UTF-8 arrive as lone surrogates
        except UnicodeError:
            print("the line is not UTF-8 text; type another", file=sys.stderr)
            continue
        except EOFError:
            if not vocab.decode(conversation.tokens[-1:]).endswith("\n"):
                out.write("\n")  # leave the shell's prompt a line of its own
            return
        except KeyboardInterrupt as e:  # Python's own for Ctrl-C; Interrupted names the signal
            if ends_session(e.signal_name if isinstance(e, Interrupted) else "SIGINT"):
                raise
            print(file=sys.stderr)
            continue
        try:
            new = encode_prompt(vocab, line + newline, "the line")
        except UsageError as e:
            print(f"{e}; type another", file=sys.stderr)
            continue
        with stops_set_flag() as stopped:
            for token in conversation.reply(new, max_new_tokens, stop):
                out.write(vocab.decode([token]))
                out.flush()
                if stopped.is_set():
                    break
        if stopped.ends_command():
            raise stopped.interrupted()


@contextlib.contextmanager
def held(session: Path | None):
    """While inside, this process alone takes up and saves session (runtime/files.py: locked), whatever name
    (a link, another spelling of its path) another process gives it; another holding it is refused in one line."""
    with contextlib.ExitStack() as stack:
        if session is not None:
            try:
                stack.enter_context(locked(session.resolve()))
            except Locked as e:
                holder = f"process {e.holder}" if e.holder else "another process"
                raise UsageError(f"--session {session} is in use by {holder}: end that session first, or choose "
                                 f"another file") from None
            except OSError as e:
                raise UsageError(f"--session {session}: cannot lock it ({e.strerror or e}); choose another "
                                 f"folder") from None
        yield


def take_up(conversation: Conversation, session: Path, checkpoint: Path, model: GPT) -> None:
    """Restore the conversation saved in session, or refuse it in one line."""
    try:
        contents = load_session(session, checkpoint, model)
        conversation.restore(contents)
    except SessionError as e:
        raise UsageError(f"--session {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as e:
        raise UsageError(f"--session {session} is damaged ({e}): start a new one under another name") from None
    fed = conversation.text.fed
    print(f"took up {session}: {len(conversation.tokens)} tokens, {fed} of them cached; the next line is all the "
          f"model reads", file=sys.stderr)


def keep_session(session: Path, conversation: Conversation, checkpoint: Path, model: GPT) -> None:
    """Save the conversation to session; a failed save leaves the file there as it was, and says so. A Ctrl-C
    cannot stop the save: only the exit is left after it."""
    try:
        with stops_set_flag():
            save_session(session, conversation.state(), checkpoint, model)
    except OSError as e:  # a full disk, ...
        raise OSError(f"cannot save the session to {session} ({e.strerror or e}); the file there is as it "
                      f"was") from None
    print(f"saved the session, {len(conversation.tokens)} tokens and their cache, to {session}", file=sys.stderr)
