"""A conversation keeps its KV cache between turns: each reply equals a fresh generation over the whole text, and
only the tokens not yet read go through the model."""

import pytest
import torch

from model import GREEDY, Sampling, generate
from model.serving.conversation import Conversation
from tiny_models import BLOCK_SIZE, VOCAB, random_model, random_tokens

TURN_LENGTHS = [3, 1, 4, 2, 5, 1, 3]  # the tokens each turn adds
REPLY = 6  # new tokens per reply: after 4 turns the text passes block_size


def fresh_greedy(model, tokens, n, keep=None) -> list[int]:
    return generate(model, torch.tensor([tokens]), n, sampling=GREEDY, keep=keep)[0, len(tokens):].tolist()


@pytest.mark.parametrize("pos_emb, keep", [("rope", None), ("learned", None), ("learned", 3)])
def test_each_reply_equals_a_fresh_greedy_generation_over_the_whole_text(pos_emb, keep):
    model = random_model(seed=0, pos_emb=pos_emb)
    fed = []
    model.blocks[0].register_forward_hook(lambda module, args, out: fed.append(args[0].size(1)))
    chat = Conversation(model, keep=keep)
    history, refilled = [], False
    for turn, n in enumerate(TURN_LENGTHS):
        new = random_tokens(n, seed=turn).tolist()
        fed.clear()
        expected = fresh_greedy(model, history + new, REPLY, keep)
        fed_by_generate = sum(fed)
        fed.clear()
        reply = list(chat.reply(new, REPLY))
        assert reply == expected, f"turn {turn}"
        text_before = len(history)
        history += new + reply
        assert chat.tokens == history
        # the previous reply's last token, this turn's tokens and the reply but its last; a learned-position
        # model past block_size reads what generate reads: the context it starts from, and its refills
        unread = (1 if text_before else 0) + n + REPLY - 1
        if pos_emb == "learned" and text_before + n > BLOCK_SIZE:
            refilled = True
            assert sum(fed) == fed_by_generate < text_before + n, f"turn {turn}"
        else:
            assert sum(fed) == unread, f"turn {turn}"
    assert len(history) > 2 * BLOCK_SIZE and refilled == (pos_emb == "learned")


def test_a_reply_stops_after_the_stop_sequence_and_the_next_turn_goes_on_from_there():
    model = random_model(seed=0, pos_emb="rope")
    prompt = random_tokens(4, seed=1).tolist()
    full = fresh_greedy(model, prompt, 20)
    stop = full[5:7]  # a pair the greedy reply reaches
    first = full.index(stop[0])
    while full[first + 1] != stop[1]:
        first = full.index(stop[0], first + 1)
    chat = Conversation(model)
    reply = list(chat.reply(prompt, 20, stop=stop))
    assert reply == full[:first + 2]
    more = list(chat.reply([], 5))
    assert more == fresh_greedy(model, prompt + reply, 5)


def test_stopping_a_reply_early_keeps_what_was_drawn():
    model = random_model(seed=0, pos_emb="learned")
    chat = Conversation(model, sampling=Sampling(temperature=1.0), generator=torch.Generator().manual_seed(0))
    steps = chat.reply(random_tokens(3).tolist(), 50)
    drawn = [next(steps) for _ in range(4)]
    steps.close()  # what Ctrl-C does to a reply
    assert chat.tokens[3:] == drawn
    chat.sampling = GREEDY
    assert list(chat.reply([1, 2], 5)) == fresh_greedy(model, chat.tokens[:-5], 5)


@pytest.mark.parametrize("new, n, fragment", [
    ([], 3, "new_tokens is empty"),
    ([VOCAB], 3, "outside the vocabulary"),
    ([1], -1, "max_new_tokens must be an integer >= 0"),
])
def test_turns_that_cannot_work_are_value_errors_and_leave_the_text_unchanged(new, n, fragment):
    chat = Conversation(random_model(seed=0))
    with pytest.raises(ValueError, match=fragment):
        next(chat.reply(new, n))
    assert chat.tokens == []
