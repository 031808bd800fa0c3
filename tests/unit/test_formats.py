"""Format detection and conversion: each fixture is a real dataset's field layout; outputs are checked exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlhfkit.errors import DataError
from rlhfkit.data.formats import (
    FORMATS,
    PreferenceExample,
    detect_format,
    parse_hh,
    to_preference_examples,
    to_prompt_examples,
    to_sft_examples,
)
from rlhfkit.data.readers import Row, read_rows

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def rows_of(name):
    return read_rows(str(FIXTURES / name))


def pairs(name, **kwargs):
    """(prompt, chosen, rejected) per kept row, plus the stats."""
    stats = {}
    examples = to_preference_examples(rows_of(name), stats=stats, **kwargs)
    return [(ex.prompt, ex.chosen, ex.rejected) for ex in examples], stats


def rows(*data, source="mem.jsonl"):
    return [Row(item, source, line) for line, item in enumerate(data, start=1)]


# ---------------------------------------------------------------- detection


@pytest.mark.parametrize(
    "fixture, task, expected",
    [
        ("rm_static.jsonl", "preference", "prompt_chosen_rejected"),
        ("synthetic_gptj.jsonl", "preference", "prompt_chosen_rejected"),
        ("yitingxie.jsonl", "preference", "prompt_chosen_rejected"),
        ("hh_rlhf.jsonl", "preference", "hh_dialogue"),
        ("shp.jsonl", "preference", "shp"),
        ("webgpt.jsonl", "preference", "webgpt"),
        ("chat_pairs.jsonl", "preference", "chat_pairs"),
        ("ultrafeedback.jsonl", "preference", "chat_pairs"),
        ("alpaca.json", "sft", "alpaca"),
        ("messages.jsonl", "sft", "messages"),
        ("prompt_response.jsonl", "sft", "prompt_response"),
        ("hh_rlhf.jsonl", "sft", "hh_dialogue"),
        ("prompt_response.jsonl", "prompt", "prompt_response"),
    ],
)
def test_detect_format(fixture, task, expected):
    assert detect_format(rows_of(fixture)[0].data, task) == expected


def test_registry_per_task():
    assert set(FORMATS["preference"]) == {"webgpt", "shp", "chat_pairs", "prompt_chosen_rejected", "hh_dialogue",
                                          "sharegpt_pairs"}
    assert set(FORMATS["sft"]) == set(FORMATS["preference"]) | {"messages", "sharegpt", "alpaca", "prompt_response"}
    assert set(FORMATS["prompt"]) == set(FORMATS["sft"]) | {"prompt_only"}


def test_parse_hh_without_blank_lines_and_with_them():
    assert parse_hh("Human: hi Assistant: hello Human: bye") == [user("hi"), assistant("hello"), user("bye")]
    assert parse_hh("\n\nHuman: a\n\nAssistant: b") == [user("a"), assistant("b")]


# ---------------------------------------------------------------- preference datasets


def test_rm_static_hh_prompt_becomes_turns():
    examples, stats = pairs("rm_static.jsonl")
    assert examples == [
        (
            [
                user("What are some cuss words in english?"),
                assistant("Here is a list of some common ones."),
                user("What is your favorite one?"),
            ],
            "I haven't even thought about it.",
            "Ass.",
        ),
        (
            [user("How do I make a cup of tea?")],
            "Boil water, pour it over a tea bag, and let it steep for three minutes.",
            "Tea is a drink.",
        ),
    ]
    assert stats == {"dropped_ties": 0, "no_shared_prompt": 0, "identical": 0, "empty_rejected": 0}


def test_synthetic_gptj_plain_prompt_is_one_user_message():
    examples, _ = pairs("synthetic_gptj.jsonl")
    assert examples[0][0] == [
        user("I was wondering if you could walk me through the process of setting up a hydroponic garden for herbs.")
    ]
    assert examples[1] == (
        [user("What are the benefits of eating avocados?")],
        "Avocados are rich in healthy fats, fibre and potassium.",
        "Avocados are green.",
    )


def test_yitingxie_markers_without_newlines_and_assistant_prefixed_replies():
    examples, _ = pairs("yitingxie.jsonl")
    assert examples == [
        (
            [
                user("Do you know why turkeys became the official food of thanksgiving?"),
                assistant("I'm not sure, do you?"),
                user("I think it was because they were plentiful."),
            ],
            "That makes sense, wild turkeys were common in New England.",
            "I don't know anything about that.",
        ),
        (
            [user("How can I keep my dog cool in summer?")],
            "Keep fresh water out and walk it in the early morning.",
            "Dogs like summer.",
        ),
    ]


def test_hh_dialogues_split_at_last_assistant_and_count_skips():
    examples, stats = pairs("hh_rlhf.jsonl")
    prompt = [
        user("What kind of noises did dinosaurs make?"),
        assistant("Humans and dinosaurs didn't live at the same time, so it's hard to say."),
        user("yes they did"),
    ]
    assert examples == [
        (
            prompt,
            "Fossils suggest some made low booming calls.",
            "to guess, and that would probably require lots of reading",
        ),
        ([user("Name a fruit.")], "An apple.", ""),  # an empty rejected reply is kept: real HH data has them
    ]
    assert stats == {"dropped_ties": 0, "no_shared_prompt": 1, "identical": 1, "empty_rejected": 1}


# Real Anthropic HH quirks (helpful-base test has 15 such pairs in 2,354): the prompt is the text up to the LAST
# "\n\nAssistant:", the response everything after it, whatever the turns before look like.
HUMANS_TYPO = (
    "\n\nHuman: What is a good name for a cat?\n\nAssistant: How about Whiskers?\n\nHumans: Something more "
    "unusual.\n\nAssistant: "
)
SPLIT_ASSISTANT = "\n\nHuman: How do I boil an egg?\n\nAssistant: Put it in boiling water.\n\nAssistant: "
TWO_HUMANS = "\n\nHuman: I need a gift idea.\n\nHuman: It is for my sister.\n\nAssistant: "
EMPTY_LAST_HUMAN = "\n\nHuman: Hi there\n\nAssistant: Hello! How can I help?\n\nHuman: \n\nAssistant: "


def hh_pair(prefix: str, chosen: str, rejected: str) -> dict:
    return {"chosen": prefix + chosen, "rejected": prefix + rejected}


def test_hh_quirks_keep_the_datasets_own_split():
    data = rows(
        hh_pair(HUMANS_TYPO, "How about Quasar?", "Cat."),
        hh_pair(SPLIT_ASSISTANT, "Leave it for eight minutes.", "Eat it raw."),
        hh_pair(TWO_HUMANS, "A book she has been wanting.", "Socks."),
        hh_pair(EMPTY_LAST_HUMAN, "Anything else?", "Bye."),
    )
    stats = {}
    examples = to_preference_examples(data, stats=stats)
    assert [(ex.prompt, ex.chosen, ex.rejected, ex.line) for ex in examples] == [
        (
            # "Humans:" is no marker: the typo'd turn stays in the assistant's, and two Assistant turns follow
            [
                user("What is a good name for a cat?"),
                assistant("How about Whiskers?\n\nHumans: Something more unusual."),
            ],
            "How about Quasar?",
            "Cat.",
            1,
        ),
        ([user("How do I boil an egg?"), assistant("Put it in boiling water.")], "Leave it for eight minutes.",
         "Eat it raw.", 2),
        ([user("I need a gift idea."), user("It is for my sister.")], "A book she has been wanting.", "Socks.", 3),
    ]
    assert stats == {"dropped_ties": 0, "no_shared_prompt": 0, "identical": 0, "empty_rejected": 0,
                     "empty_prompt": 1}
    # the same rows as SFT demonstrations and as PPO prompts
    sft_stats = {}
    assert [ex.response for ex in to_sft_examples(data, stats=sft_stats)] == [
        "How about Quasar?", "Leave it for eight minutes.", "A book she has been wanting."]
    assert sft_stats == {"dropped_ties": 0, "empty_prompt": 1}
    prompt_stats = {}
    assert [ex.prompt for ex in to_prompt_examples(data, stats=prompt_stats)] == [ex.prompt for ex in examples]
    assert prompt_stats == {"empty_prompt": 1}
    with pytest.raises(DataError, match=r"^mem\.jsonl:4: field 'chosen': empty$"):
        to_preference_examples(data, strict=True)


def test_a_prompt_may_end_with_an_assistant_turn_in_any_format():
    (example,) = to_sft_examples(rows({"messages": [user("a"), assistant("b"), assistant("c")]}))
    assert (example.prompt, example.response) == ([user("a"), assistant("b")], "c")
    (prompt,) = to_prompt_examples(rows({"prompt": [user("a"), assistant("b")]}))
    assert prompt.prompt == [user("a"), assistant("b")]


def test_shp_labels_pick_the_preferred_comment():
    examples, _ = pairs("shp.jsonl")
    assert examples[0][1:] == ("Yes, publish or perish drives a lot of behaviour.", "Depends on the field.")
    assert examples[0][0][0]["content"].startswith("In an interview right before receiving the 2013 Nobel prize")
    assert examples[1] == (
        [user("Why does my bread come out dense?")],
        "Your dough is probably under-proofed; let it rise until doubled.",
        "Use more yeast.",
    )


def test_webgpt_higher_score_wins_and_ties_are_dropped():
    examples, stats = pairs("webgpt.jsonl")
    assert examples == [
        (
            [user("Why is the sky blue?")],
            "Rayleigh scattering makes blue light dominate the sky [1].",
            "Shorter wavelengths scatter more in air [1].",
        ),
        (
            [user("How do vaccines work?")],
            "They train the immune system with a harmless antigen.",
            "They are injections.",
        ),
    ]
    assert stats["dropped_ties"] == 1


def test_chat_pairs_shared_prefix_or_explicit_prompt():
    examples, stats = pairs("chat_pairs.jsonl")
    assert examples == [
        ([{"role": "system", "content": "Be brief."}, user("What is 2+2?")], "4", "5"),
        ([user("Name a colour.")], "Blue.", "Seven."),
        ([user("Hi"), assistant("Hello!"), user("Bye")], "Goodbye!", "No."),
    ]
    uf, _ = pairs("ultrafeedback.jsonl")
    assert uf == [([user("Write a haiku about rain.")], "Soft rain on the roof", "Rain is wet.")]
    split = rows({"chosen": [user("a"), assistant("b")], "rejected": [user("x"), assistant("y")]})
    to_preference_examples(split, stats=stats)
    assert stats["no_shared_prompt"] == 1


def test_preference_examples_keep_source_and_line():
    example = to_preference_examples(rows_of("hh_rlhf.jsonl"))[1]
    assert isinstance(example, PreferenceExample)
    assert (example.source, example.line) == (str(FIXTURES / "hh_rlhf.jsonl"), 4)


# ---------------------------------------------------------------- SFT and prompts


def test_sft_formats():
    alpaca = to_sft_examples(rows_of("alpaca.json"))
    assert [(ex.prompt, ex.response) for ex in alpaca] == [
        ([user("Give three tips for staying healthy.")], "1. Eat well.\n2. Exercise.\n3. Sleep."),
        ([user("Translate to French.\n\nGood morning")], "Bonjour"),
    ]
    messages = to_sft_examples(rows_of("messages.jsonl"))
    assert [(ex.prompt, ex.response) for ex in messages] == [
        ([{"role": "system", "content": "You are a helpful assistant."}, user("Translate 'chat' to English.")], "Cat."),
        (
            [user("Hi"), assistant("Hello! How can I help?"), user("Tell me a joke.")],
            "Why did the chicken cross the road?",
        ),
    ]
    plain = to_sft_examples(rows_of("prompt_response.csv"))
    assert [(ex.prompt, ex.response, ex.line) for ex in plain] == [
        ([user("What is the capital of Italy?")], "Rome.", 2),  # file lines: line 1 is the header
        ([user("List two colours.")], "Red,\nblue.", 3),
    ]


def test_alpaca_system_and_history_become_turns():
    row = {
        "instruction": "And in French?",
        "input": "",
        "output": "Bonjour",
        "system": "Be polite.",
        "history": [["Say hello in Spanish.", "Hola"]],
    }
    (example,) = to_sft_examples(rows(row))
    assert example.prompt == [
        {"role": "system", "content": "Be polite."},
        user("Say hello in Spanish."),
        assistant("Hola"),
        user("And in French?"),
    ]
    with pytest.raises(DataError, match=r"^mem\.jsonl:1: field 'history': expected \[query, answer\] string pairs"):
        to_sft_examples(rows({**row, "history": ["just one"]}))
    with pytest.raises(DataError, match=r"^mem\.jsonl:1: field 'system': expected a string, got list$"):
        to_sft_examples(rows({**row, "system": ["Be polite."]}))
    (plain,) = to_sft_examples(rows({**row, "system": None, "history": None}))  # null: no system turn
    assert plain.prompt == [user("And in French?")]


def test_stats_add_up_over_sources():
    stats = {}
    to_preference_examples(rows_of("hh_rlhf.jsonl"), stats=stats)
    to_preference_examples(rows_of("webgpt.jsonl"), stats=stats)
    assert stats == {"dropped_ties": 1, "no_shared_prompt": 1, "identical": 1, "empty_rejected": 1}


def test_sft_from_preference_rows_uses_the_chosen_side():
    hh = to_sft_examples(rows_of("hh_rlhf.jsonl"))
    assert (hh[0].response, hh[1].prompt) == (
        "Fossils suggest some made low booming calls.",
        [user("Can you help me with my homework?")],
    )
    assert len(hh) == 4  # SFT does not need a shared prompt or distinct sides
    stats = {}
    webgpt = to_sft_examples(rows_of("webgpt.jsonl"), format="webgpt", stats=stats)
    assert [ex.response for ex in webgpt] == [
        "Rayleigh scattering makes blue light dominate the sky [1].",
        "They train the immune system with a harmless antigen.",
    ]
    assert stats == {"dropped_ties": 1}  # a tie has no chosen side
    # SFT reads only the chosen side, so chat pairs whose prefixes differ still give a demonstration.
    split = rows({"chosen": [user("a"), assistant("b")], "rejected": [user("x"), assistant("y")]})
    assert [(ex.prompt, ex.response) for ex in to_sft_examples(split)] == [([user("a")], "b")]
    rm_static = to_sft_examples(rows_of("rm_static.jsonl"))
    assert rm_static[1].response == "Boil water, pour it over a tea bag, and let it steep for three minutes."


def test_prompts_from_any_format():
    assert [ex.prompt for ex in to_prompt_examples(rows_of("webgpt.jsonl"))] == [
        [user("Why is the sky blue?")],
        [user("How do vaccines work?")],
        [user("What is a black hole?")],
    ]  # ties too
    assert to_prompt_examples(rows_of("messages.jsonl"))[1].prompt == [
        user("Hi"),
        assistant("Hello! How can I help?"),
        user("Tell me a joke."),
    ]
    assert to_prompt_examples(rows_of("hh_rlhf.jsonl"))[1].prompt == [user("Can you help me with my homework?")]
    assert to_prompt_examples(rows_of("chat_pairs.jsonl"))[1].prompt == [user("Name a colour.")]
    only = to_prompt_examples(rows({"prompt": "Tell a story."}, {"prompt": [user("Hi")]}))
    assert [(ex.prompt, ex.line) for ex in only] == [([user("Tell a story.")], 1), ([user("Hi")], 2)]


# ---------------------------------------------------------------- options


def test_field_overrides_rename_columns_before_detection():
    data = rows({"question": "What is 1+1?", "answer": "2", "id": 7})
    examples = to_sft_examples(data, fields={"prompt": "question", "response": "answer"})
    assert [(ex.prompt, ex.response) for ex in examples] == [([user("What is 1+1?")], "2")]
    with pytest.raises(DataError) as info:
        to_sft_examples(data, fields={"prompt": "query", "response": "answer"})
    assert str(info.value) == (
        "mem.jsonl:1: field 'query': missing (mapped to 'prompt' by fields; row has keys: question, answer, id)"
    )
    with pytest.raises(DataError, match=r"^config key 'data.fields': unknown canonical field\(s\) respone \(known: .*response"):
        to_sft_examples(data, fields={"respone": "answer"})


def test_field_mappings_may_swap_or_share_columns():
    """Every mapping reads the original row: {chosen: rejected, rejected: chosen} swaps a file whose labels are the
    wrong way round (applied one by one, the second read the first's result)."""
    pair = rows({"prompt": "Hi", "chosen": "bad", "rejected": "good"})
    swapped = to_preference_examples(pair, fields={"chosen": "rejected", "rejected": "chosen"})
    assert [(ex.chosen, ex.rejected) for ex in swapped] == [("good", "bad")]
    shared = to_sft_examples(rows({"q": "Say hi", "a": "hi"}), fields={"prompt": "q", "response": "a"})
    assert [(ex.prompt, ex.response) for ex in shared] == [([user("Say hi")], "hi")]


def test_forced_format_and_unknown_format_name():
    forced = to_sft_examples(rows_of("rm_static.jsonl"), format="prompt_response")
    assert forced[0].response == "I haven't even thought about it."
    with pytest.raises(
        DataError, match=r"^unknown sft format 'oasst' \(known: auto, webgpt, shp, .*prompt_response\)$"
    ):
        to_sft_examples(rows_of("rm_static.jsonl"), format="oasst")
    with pytest.raises(
        DataError, match=r"alpaca\.json:2: field 'chosen': missing \(row has keys: instruction, input, output\)$"
    ):
        to_preference_examples(rows_of("alpaca.json"), format="hh_dialogue")


# ---------------------------------------------------------------- errors


def test_undetectable_rows_suggest_the_fields_option():
    with pytest.raises(DataError) as info:
        to_sft_examples(rows({"text": "Once upon a time."}))
    assert str(info.value) == (
        "mem.jsonl:1: cannot detect a sft format from keys (text); known formats: webgpt, shp, chat_pairs, "
        "prompt_chosen_rejected, hh_dialogue, sharegpt_pairs, messages, sharegpt, alpaca, prompt_response; plain {text} rows are pretraining "
        "text, not prompt/response data; map columns with data.fields, e.g. "
        "'data.fields={prompt: question, response: answer}'"
    )
    with pytest.raises(DataError, match=re.escape("map columns with data.fields, e.g. "
                                                  "'data.fields={response: completion}'")):
        to_sft_examples(rows({"prompt": "a", "completion": "b"}))


def test_missing_field_in_a_later_row():
    data = rows(
        {"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "response": "b"}, source="data/train.jsonl"
    )
    with pytest.raises(
        DataError, match=r"^data/train\.jsonl:2: field 'chosen': missing \(row has keys: prompt, response\)$"
    ):
        to_preference_examples(data)


@pytest.mark.parametrize(
    "row, task, message",
    [
        ({"prompt": "Hi", "response": 3}, "sft", "mem.jsonl:1: field 'response': expected a string, got int"),
        (
            {"messages": [user("Hi"), {"role": "bot", "content": "x"}]},
            "sft",
            "mem.jsonl:1: field 'messages': message 2: role 'bot' is not one of system, user, assistant, tool",
        ),
        (
            {"messages": [user("Hi")]},
            "sft",
            "mem.jsonl:1: field 'messages': the last message must be the assistant's response (got role 'user')",
        ),
        (
            {"history": "q", "human_ref_A": "a", "human_ref_B": "b", "labels": 2},
            "preference",
            "mem.jsonl:1: field 'labels': expected 0 or 1, got 2",
        ),
        (
            {"question": {"id": "q"}, "answer_0": "a", "answer_1": "b", "score_0": 1, "score_1": 0},
            "preference",
            "mem.jsonl:1: field 'question': expected a 'full_text' key (question has keys: id)",
        ),
        (
            {"chosen": "Hello there", "rejected": "Hi"},
            "preference",
            "mem.jsonl:1: cannot detect a preference format from keys (chosen, rejected); known formats: webgpt, "
            "shp, chat_pairs, prompt_chosen_rejected, hh_dialogue, sharegpt_pairs; map columns with data.fields, e.g. "
            "'data.fields={prompt: question, chosen: better, rejected: worse}'",
        ),
        (
            {"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "Hi"},
            "preference",
            "mem.jsonl:1: field 'rejected': expected an HH dialogue starting with 'Human:'",
        ),
    ],
)
def test_structural_errors_name_file_line_and_field_even_when_not_strict(row, task, message):
    convert = {"sft": to_sft_examples, "preference": to_preference_examples}[task]
    with pytest.raises(DataError) as info:
        convert(rows(row))
    assert str(info.value) == message


PLAIN_SFT = {"prompt": "Hi", "response": "Hello"}
PLAIN_PAIR = {"prompt": "Hi", "chosen": "Hello", "rejected": "Go"}
HH_PAIR = {"chosen": "\n\nHuman: hi\n\nAssistant: a", "rejected": "\n\nHuman: hi\n\nAssistant: b"}
CHAT_PAIR = {"chosen": [user("Hi"), assistant("a")], "rejected": [user("Hi"), assistant("b")]}
# (a usable row of the format, an unusable one, task, the stats key it is counted under, the strict error)
UNUSABLE = [
    (PLAIN_SFT, {"prompt": "Hi", "response": "   "}, "sft", "empty_response", "mem.jsonl:2: field 'response': empty"),
    (PLAIN_SFT, {"prompt": " ", "response": "ok"}, "sft", "empty_prompt", "mem.jsonl:2: field 'prompt': empty"),
    (
        PLAIN_SFT,
        {"prompt": [assistant("Hi")], "response": "x"},
        "sft",
        "no_user_turn",
        "mem.jsonl:2: field 'prompt': the prompt has no user message",
    ),
    (
        PLAIN_SFT,
        {"prompt": [user("Hi"), assistant("")], "response": "x"},
        "prompt",
        "empty_prompt",
        "mem.jsonl:2: field 'prompt': empty",
    ),
    (PLAIN_PAIR, {"prompt": "Hi", "chosen": "\n", "rejected": "no"}, "preference", "empty_response",
     "mem.jsonl:2: field 'chosen': empty"),
    (
        HH_PAIR,
        {"chosen": "\n\nHuman: hi\n\nAssistant:", "rejected": "\n\nHuman: hi\n\nAssistant: yo"},
        "preference",
        "empty_response",
        "mem.jsonl:2: field 'chosen': empty",
    ),
    (
        CHAT_PAIR,
        {"chosen": [assistant("Hi"), assistant("a")], "rejected": [assistant("Hi"), assistant("b")]},
        "preference",
        "no_user_turn",
        "mem.jsonl:2: field 'chosen': the prompt has no user message",
    ),
]


@pytest.mark.parametrize("good, row, task, reason, message", UNUSABLE)
def test_unusable_rows_are_skipped_and_counted_or_refused_when_strict(good, row, task, reason, message):
    convert = {"sft": to_sft_examples, "preference": to_preference_examples, "prompt": to_prompt_examples}[task]
    stats = {}
    examples = convert(rows(good, row, good), stats=stats)
    assert [ex.line for ex in examples] == [1, 3]  # the run goes on with the usable rows
    assert {key: n for key, n in stats.items() if n} == {reason: 1}
    with pytest.raises(DataError) as info:
        convert(rows(good, row, good), strict=True)
    assert str(info.value) == message


def test_strict_rows_still_skips_rows_without_a_preference():
    # ties and differing prompts are not data errors: strict mode skips and counts them as before
    stats = {}
    split = rows({"chosen": [user("a"), assistant("b")], "rejected": [user("x"), assistant("y")]})
    assert to_preference_examples(split, stats=stats, strict=True) == []
    assert stats["no_shared_prompt"] == 1


def test_no_rows():
    with pytest.raises(DataError, match="no rows"):
        to_sft_examples([])


# ---------------------------------------------------------------- real data


HH_FILE = SHARED_DATA / "preference" / "hh-rlhf-helpful-online.test.jsonl.gz"


@pytest.mark.skipif(not HH_FILE.is_file(), reason=f"the real HH file {HH_FILE} is absent")
def test_every_row_of_the_real_hh_file_converts_or_is_counted():
    data = read_rows(str(HH_FILE))
    assert len(data) == 1137
    stats = {}
    hh = to_preference_examples(data, stats=stats)
    # 1,137 pairs: two have identical sides; three keep an empty rejected reply; nothing else is left out.
    assert len(hh) == 1135
    assert stats == {"dropped_ties": 0, "no_shared_prompt": 0, "identical": 2, "empty_rejected": 3}
    assert len(hh) + stats["identical"] == len(data)
    assert hh[0].prompt == [user("If I were to give you some coordinates, could you tell me where the location is?")]
    assert all(ex.prompt[-1]["content"] and ex.chosen for ex in hh)
    # this split alternates everywhere (the helpful-base test split has the quirks tested above)
    assert all(ex.prompt[-1]["role"] == "user" for ex in hh)
    sft_stats = {}
    assert len(to_sft_examples(data, stats=sft_stats)) == 1137 and sft_stats == {"dropped_ties": 0}
    prompt_stats = {}
    assert len(to_prompt_examples(data, stats=prompt_stats)) == 1137 and prompt_stats == {}
    assert len(to_preference_examples(data, strict=True)) == 1135  # strict: no row is an error either


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason=f"shared data folder {SHARED_DATA} is absent")
def test_real_alpaca_file():
    alpaca = to_sft_examples(read_rows(str(SHARED_DATA / "sft" / "alpaca_en_demo.json")))
    assert len(alpaca) == 999
    assert alpaca[0].prompt == [user("Describe a process of making crepes.")]


def test_score_reads_swapped_columns_as_pairs():
    """`rlhfkit score --field chosen=rejected --field rejected=chosen` tells pairs from SFT rows on the renamed
    row (renaming one by one left keys prompt, rejected: read as prompt/response rows)."""
    from rlhfkit.commands.score import _task

    pair = rows({"prompt": "Hi", "chosen": "bad", "rejected": "good"})
    assert _task(pair, {"chosen": "rejected", "rejected": "chosen"}, "auto") == "preference"
    assert _task(rows({"q": "Hi", "a": "hello"}), {"prompt": "q", "response": "a"}, "auto") == "sft"


def test_sharegpt_conversations_and_pairs_read_as_chat_messages():
    """FastChat / LLaMA-Factory ShareGPT rows ({conversations: [{from, value}]}, an optional `system`; preference
    rows with `chosen` / `rejected` turns) need no code: detected, speakers mapped to roles."""
    from rlhfkit.data.formats import detect_format, to_prompt_examples

    conv = {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                                     {"from": "human", "value": "Say apple"},
                                                     {"from": "gpt", "value": "apple"}]}
    assert detect_format(conv, "sft") == "sharegpt"
    [ex] = to_sft_examples(rows(conv))
    assert ex.prompt == [{"role": "system", "content": "Be brief."}, user("Hi"), assistant("Hello"),
                         user("Say apple")] and ex.response == "apple"
    assert to_prompt_examples(rows(conv))[0].prompt == ex.prompt
    pair = {"conversations": [{"from": "human", "value": "Say apple"}], "chosen": {"from": "gpt", "value": "apple"},
            "rejected": {"from": "gpt", "value": "pear"}}
    assert detect_format(pair, "preference") == "sharegpt_pairs"
    [p] = to_preference_examples(rows(pair))
    assert (p.prompt, p.chosen, p.rejected) == ([user("Say apple")], "apple", "pear")
    with pytest.raises(DataError, match=r"^mem.jsonl:1: field 'conversations': turn 2: 'from' 'bot' is not one of "
                                        r"human, user, gpt"):
        to_sft_examples(rows({"conversations": [{"from": "human", "value": "Hi"}, {"from": "bot", "value": "x"}]}))
