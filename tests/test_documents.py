"""What a training document is (issue 32): conversations with the loss on the assistant's tokens
only, packed documents that cannot see each other (document masks), and mixtures of sources.

In-process: the labels of conversations against a render made here without the template, the two
ways of finding the assistant's tokens, the position ids of packed and streamed blocks, the
mixture's shares and its file's errors. Launched: conversations and a mixture, each trained and
resumed (train.py on cpu.yaml); the document-mask check under cpu.yaml, ddp.yaml and fsdp.yaml
(tests/scripts/document_mask.py)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, BloomConfig, GPT2Config, LlamaConfig, OPTConfig, Qwen2Config

from common.config import ConfigError
from common.data import build_tokenizer
from conftest import ROOT, SYNTHETIC, Run, check_exact_resume, launch, launch_two_processes, parse_train
from synthetic import CHAT_TEMPLATE, conversations_file, save_chat_tokenizer, synthetic_conversations
from train_extras import document_mask
from train_extras.data import assemble, formats, packing, render, sources
from train_extras.resume import checkpoint

SEQ = 128


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tokenizer with a chat template, one without, and a JSONL of 600 multi-turn conversations."""
    folder = tmp_path_factory.mktemp("chat")
    save_chat_tokenizer(folder / "tokenizer")
    save_chat_tokenizer(folder / "no_template", template=None)
    (folder / "template.jinja").write_text(CHAT_TEMPLATE)
    return {"folder": folder, "tokenizer": str(folder / "tokenizer"), "no_template": str(folder / "no_template"),
            "data": conversations_file(folder, 600), "template": str(folder / "template.jinja")}


def build(argv):
    cfg = parse_train(argv)
    tokenizer = build_tokenizer(cfg)
    return cfg, tokenizer, assemble.build(cfg, tokenizer)


def independent_render(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The conversation as CHAT_TEMPLATE lays it out, assembled here piece by piece (no Jinja):
    (token ids, 1 on what the assistant writes: its content and its end-of-turn)."""
    pieces = [(tokenizer.bos_token, 0)] if tokenizer.bos_token else []
    for message in messages:
        mine = message["role"] == "assistant"
        pieces += [(f"<|{message['role']}|>\n", 0), (message["content"] + "<|end|>", int(mine))]
    ids, mask = [], []
    for text, target in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [target] * len(piece)
    return ids, mask


# ---- conversations, in-process ----

@pytest.mark.quick
def test_the_template_markers_and_the_prefix_differences_agree(chat):
    """Both ways of finding the assistant's tokens, on a template that has both, for every conversation."""
    tokenizer = AutoTokenizer.from_pretrained(chat["tokenizer"])
    assert render.GENERATION_MARKER.search(tokenizer.chat_template)
    for messages in synthetic_conversations(600):
        by_markers = render.by_markers(tokenizer, messages)
        assert render.by_prefixes(tokenizer, messages) == by_markers
        assert by_markers == independent_render(tokenizer, messages)


def messages_of(source_rows) -> list[list[dict]]:
    """formats.py's conversations (JSON text) as message lists."""
    return [json.loads(example)["messages"] for example in source_rows["example"]]


PACKINGS = {"concatenate": ["--packing_strategy", "concatenate"], "best_fit": [], "rows": ["--packing", "false"]}


@pytest.mark.quick
def test_the_prefix_differences_without_offsets_and_a_template_they_cannot_read(chat):
    """A tokenizer without offsets (the byte tokenizer, in Python) tokenises each prefix apart: the
    same tokens. A template whose assistant header ends inside a token (a space that BPE joins to
    the answer's first word) cannot be read from the prefixes: one error line."""
    byte_tokenizer = build_tokenizer(parse_train([]))
    byte_tokenizer.chat_template = CHAT_TEMPLATE
    assert not byte_tokenizer.is_fast
    for messages in synthetic_conversations(40):
        assert render.by_prefixes(byte_tokenizer, messages) == independent_render(byte_tokenizer, messages)
    tokenizer = AutoTokenizer.from_pretrained(chat["tokenizer"])
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|assistant|>\n", "<|assistant|> ").replace(
        "{% generation %}", "").replace("{% endgeneration %}", "")
    with pytest.raises(ConfigError, match="cannot be found from the prefixes: give a template with"):
        render.by_prefixes(tokenizer, synthetic_conversations(1)[0])


@pytest.mark.quick
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_labels_are_minus_100_exactly_where_the_next_token_is_not_the_assistants(chat, packing):
    """Token by token over the whole training set: every block (concatenated), row of whole
    conversations (best fit, the default) or row of one conversation against the independent render
    of the conversations in the training split."""
    cfg, tokenizer, built = build(["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", chat["data"],
                                   "--seq_len", str(SEQ), *PACKINGS[packing]])
    assert built.kind == "conversations"
    source = formats.load_source(cfg)
    rendered = [independent_render(tokenizer, m) for m in messages_of(source.train)]
    kept = [(ids, mask) for ids, mask in rendered if len(ids) <= SEQ + 1]  # --overlong drop (the default)
    assert built.facts["conversations"] == {"kept": len(kept), "truncated": 0,
                                            "dropped_overlong": len(rendered) - len(kept),
                                            "dropped_no_assistant_token": 0}
    assert 0 < len(rendered) - len(kept) < len(kept)  # some were dropped, most kept
    if packing == "concatenate":
        stream = np.concatenate([ids for ids, _ in kept])
        targets = np.concatenate([mask for _, mask in kept])
        assert len(built.train) == len(stream) // (SEQ + 1)
        for index in range(len(built.train)):
            block = slice(index * (SEQ + 1), (index + 1) * (SEQ + 1))
            expected = np.where(targets[block][1:] == 1, stream[block][1:], -100)
            item = built.train[index]
            assert item["input_ids"].tolist() == stream[block][:-1].tolist()
            assert item["labels"].tolist() == expected.tolist(), index
    elif packing == "best_fit":  # each conversation whole in one row, found there by its positions
        pool = {}
        for ids, mask in kept:  # a conversation's inputs and labels; its last token predicts nothing
            labels = [t if m else -100 for t, m in zip(ids[1:], mask[1:])] + [-100]
            pool.setdefault(tuple(ids), []).append(labels)
        pad = tokenizer.pad_token_id
        for index in range(len(built.train)):
            item = built.train[index]
            positions, ids, labels = item["position_ids"].tolist(), item["input_ids"].tolist(), item["labels"].tolist()
            starts = [t for t, p in enumerate(positions) if p == 0] + [SEQ]
            for a, b in zip(starts, starts[1:]):
                if set(ids[a:b]) == {pad}:  # the row's padding: never a label
                    assert set(labels[a:b]) == {-100}
                    continue
                # the row's last conversation may end on the block's last token, which is a label only
                full = next(key for key in (tuple(ids[a:b]), tuple(ids[a:b] + [labels[b - 1]])) if pool.get(key))
                assert pool[full].pop()[: b - a] == labels[a:b], index
        assert not any(pool.values())  # every conversation exactly once
        assert built.facts["rows"]["examples"] == len(kept)
    else:
        assert len(built.train) == len(kept)
        for index, (ids, mask) in enumerate(kept):
            item = built.train[index]
            labels = [t if m else -100 for t, m in zip(ids[1:], mask[1:])]
            assert item["labels"].tolist() == labels + [-100] * (SEQ - len(labels)), index
    # the held-out conversations are scored on the assistant's tokens only, too
    held_out = built.held_out[""][0]
    assert (held_out["labels"] == -100).any() and (held_out["labels"] != -100).any()


@pytest.mark.quick
def test_best_fit_keeps_every_example_whole_and_pads_little():
    """400 examples of 32-242 tokens (log-normal, median 87: a chat set's shape) in rows of 257
    (--seq_len 256): concatenated, 151 are cut at a block's edge; best fit puts each whole in one row,
    in 155 rows where 154 is the least any packing could use (1.0% padding)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(90), 0.5, size=400).astype(np.int64), 32, 242)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = packing.FittedRows(np.ones(int(lengths.sum()), dtype=np.uint16), starts, lengths, 256, pad_id=0)
    placed = sorted(i for row in rows.rows for i in row)
    assert placed == list(range(400)) and all(lengths[row].sum() <= 257 for row in rows.rows)
    assert (len(rows), rows.used, int(lengths.sum())) == (155, 39389, 39389)
    filled = [int(lengths[row].sum()) for row in rows.rows]  # a row's last token is no input
    padding = sum(256 - min(f, 256) for f in filled)
    assert padding == 395  # 1.0% of the 155 x 256 input positions
    assert packing.describe_rows(rows, parse_train(["--seq_len", "256"]))["rows"]["padding_share"] == 395 / (155 * 256)
    whole_in_a_block = sum(start // 257 == (start + n - 1) // 257 for start, n in zip(starts, lengths))
    assert whole_in_a_block == 249  # concatenated: the other 151 are split over two blocks
    index = next(i for i, row in enumerate(rows.rows) if len(row) >= 3)  # labels: none across an example's edge
    item, first = rows[index], rows.rows[index]
    edges = np.cumsum(lengths[first])
    assert item["labels"][edges[:-1] - 1].tolist() == [-100] * (len(first) - 1)
    assert item["position_ids"][edges[:-1]].tolist() == [0] * (len(first) - 1)


@pytest.mark.quick
def test_overlong_conversations_are_truncated_when_asked(chat):
    _, tokenizer, dropped = build(["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", chat["data"],
                                   "--seq_len", "64", "--packing", "false"])
    _, _, truncated = build(["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", chat["data"],
                             "--seq_len", "64", "--packing", "false", "--overlong", "truncate"])
    drop, cut = dropped.facts["conversations"], truncated.facts["conversations"]
    assert drop["dropped_overlong"] == cut["truncated"] > 0 and drop["kept"] == cut["kept"]
    assert len(truncated.train) == cut["kept"] + cut["truncated"]  # every truncated one still has an answer
    assert "truncated" in render.describe(cut) and cut["dropped_no_assistant_token"] == 0


@pytest.mark.quick
def test_a_conversations_column_beside_the_text_column_leaves_the_data_text(chat, tmp_path):
    """Rows with both a `text` and a `messages` column stay text (as before conversations existed),
    unless --chat_column names the messages."""
    rows = tmp_path / "both.jsonl"
    rows.write_text("".join(json.dumps({"text": f"document {i} " * 20, "messages": m}) + "\n"
                            for i, m in enumerate(synthetic_conversations(600))))
    argv = ["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", str(rows), "--seq_len", str(SEQ)]
    assert build(argv)[2].kind == "text"
    assert build(argv + ["--chat_column", "messages"])[2].kind == "conversations"


@pytest.mark.quick
def test_a_template_that_fails_on_a_conversation_names_its_file_and_line(chat, tmp_path):
    """The strict template's error names the conversation's line in its file, not its index in the
    shuffled split; a blank line is no row and still counts as a line."""
    strict = tmp_path / "strict.jinja"  # as many templates do: no system message (or: roles must alternate)
    strict.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                      "{% endif %}{{ m['content'] }}{% endfor %}")
    talks = synthetic_conversations(40)
    lines = [json.dumps({"messages": m if i == 29 else m[1:]}) for i, m in enumerate(talks)]  # one system message
    rows = tmp_path / "strict.jsonl"
    rows.write_text("\n".join(lines[:3] + [""] + lines[3:]) + "\n")  # row 29 is on line 31
    argv = ["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", str(rows), "--seq_len", str(SEQ)]
    with pytest.raises(ConfigError) as err:
        build(argv + ["--chat_template", str(strict)])
    assert str(err.value) == (f"{rows} line 31: the chat template cannot render this conversation: "
                              "TemplateError: no system")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ConfigError, match="is not a Jinja template: line 1: Unexpected end of template"):
        build(argv + ["--chat_template", str(broken)])


@pytest.mark.quick
def test_a_chat_template_for_text_data_is_refused(chat, tmp_path):
    """--chat_template renders conversations: given for text it rendered nothing and was written into
    the export all the same. One line instead, for one source or a mixture of text sources."""
    refusal = (f"--chat_template {chat['template']} renders conversations, and the data holds text only (no column "
               "of messages or ShareGPT turns was found): drop --chat_template, or name the conversations' column "
               "with --chat_column")
    spec = tmp_path / "prose.yaml"
    spec.write_text(f"sources:\n  - name: prose\n    data_files: {SYNTHETIC}\n    weight: 1\n")
    for data in (["--data_files", SYNTHETIC], ["--data_mixture", str(spec)]):
        cfg = parse_train(["--tokenizer_name_or_path", chat["no_template"], *data, "--seq_len", str(SEQ),
                           "--chat_template", chat["template"]])
        tokenizer = build_tokenizer(cfg)
        with pytest.raises(ConfigError) as err:
            assemble.build(cfg, tokenizer)
        assert str(err.value) == refusal and tokenizer.chat_template is None


# ---- chat formats as people write them: ShareGPT, OpenAI content parts ----

SHAREGPT_SENDER = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def chat_forms(folder, talks: list[list[dict]]) -> dict:
    """The same conversations as messages, as ShareGPT turns, and with contents as OpenAI parts
    (each split in two text parts; every third one left a string: a file mixes both)."""
    def parts(text: str, i: int):
        return text if i % 3 == 0 else [{"type": "text", "text": text[:len(text) // 2]},
                                        {"type": "text", "text": text[len(text) // 2:]}]

    forms = {"messages": [{"messages": m} for m in talks],
             "sharegpt": [{"conversations": [{"from": SHAREGPT_SENDER[x["role"]], "value": x["content"]} for x in m]}
                          for m in talks],
             "parts": [{"messages": [{"role": x["role"], "content": parts(x["content"], i)} for i, x in enumerate(m)]}
                       for m in talks]}
    paths = {}
    for name, rows in forms.items():
        paths[name] = folder / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths


@pytest.mark.quick
@pytest.mark.parametrize("packing", ["true", "false"])
def test_sharegpt_and_content_parts_train_exactly_as_the_same_messages(chat, tmp_path, packing):
    """Token by token, every training and held-out row (input ids, labels, positions) of the
    ShareGPT and content-parts files equals that of the same conversations written as messages
    (a tool turn among them); and the assistant's tokens are those of the independent render."""
    talks = synthetic_conversations(80)
    for i in (0, 7, 31):  # a tool's answer inside the conversation
        talks[i] = talks[i][:3] + [{"role": "tool", "content": "toy tool output."}] + talks[i][3:]
    paths = chat_forms(tmp_path, talks)
    built = {name: build(["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", str(path),
                          "--seq_len", str(SEQ), "--packing", packing, "--eval_fraction", "0.2"])
             for name, path in paths.items()}
    cfg, tokenizer, reference = built["messages"]
    assert reference.kind == "conversations" and reference.facts["conversations"]["kept"] > 40
    for name in ("sharegpt", "parts"):
        other = built[name][2]
        assert other.facts == reference.facts and len(other.train) == len(reference.train) > 0, name
        for ours, theirs in ((other.train, reference.train), (other.held_out[""], reference.held_out[""])):
            assert len(ours) == len(theirs)
            for index in range(len(theirs)):
                a, b = ours[index], theirs[index]
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "index"), (name, index)
    # the normalised conversations are the messages themselves, and render as the template lays them out
    source = formats.load_source(parse_train(["--tokenizer_name_or_path", chat["tokenizer"], "--data_files",
                                              str(paths["sharegpt"]), "--seq_len", str(SEQ)]))
    for row, messages in zip(source.train["row"], messages_of(source.train)):
        assert messages == talks[row]
        assert render.by_markers(tokenizer, messages) == independent_render(tokenizer, talks[row])


@pytest.mark.quick
@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Look."},
                                                {"type": "image_url", "image_url": {"url": "x.png"}}]},
                   {"role": "assistant", "content": "A cat."}]},
     "message 0 has a content part 'image_url': only text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "..."}}]},
                   {"role": "assistant", "content": "Hello."}]},
     "message 0 has a content part 'input_audio'"),
    ({"conversations": [{"from": "human", "value": "Hi."}, {"from": "bing", "value": "Hello."}]},
     "turn 1 is from 'bing': ShareGPT's senders read here are system, human, user, gpt, assistant, tool, observation"),
])
def test_a_row_that_cannot_be_read_is_one_line_naming_its_file_and_line(chat, tmp_path, row, message):
    good = synthetic_conversations(60)
    if "conversations" in row:
        lines = [{"conversations": [{"from": SHAREGPT_SENDER[x["role"]], "value": x["content"]} for x in m]}
                 for m in good]
    else:
        lines = [{"messages": m} for m in good]
    lines[12] = row
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ConfigError) as err:
        build(["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", str(path), "--seq_len", str(SEQ),
               "--eval_fraction", "0.2"])
    assert str(err.value).startswith(f"{path} line 13: {message}") and "\n" not in str(err.value)


@pytest.mark.quick
def test_a_tokenizer_without_a_chat_template_is_one_line_and_a_template_file_supplies_one(chat):
    argv = ["--tokenizer_name_or_path", chat["no_template"], "--data_files", chat["data"], "--seq_len", str(SEQ)]
    with pytest.raises(ConfigError, match="no chat template to render them: give one with --chat_template") as err:
        build(argv)
    assert "\n" not in str(err.value)
    _, _, built = build(argv + ["--chat_template", chat["template"]])
    assert built.kind == "conversations" and len(built.train) > 0
    with pytest.raises(ConfigError, match="chat template file not found: nowhere.jinja"):
        parse_train(argv + ["--chat_template", "nowhere.jinja"])
    with pytest.raises(ConfigError, match=r"no column 'chat' \(has \['id', 'messages'\]\)"):
        build(argv + ["--chat_column", "chat"])
    with pytest.raises(ConfigError, match="column 'id' is not a list of {role, content} messages"):
        build(argv + ["--chat_column", "id"])


# ---- document masks, in-process ----

@pytest.mark.quick
def test_positions_restart_at_each_document_and_at_each_block():
    starts = np.array([0, 5, 9, 30])
    assert restart(starts, 0, 12) == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert restart(starts, 12, 6) == [0, 1, 2, 3, 4, 5]  # a document carried over starts the block at 0
    assert restart(starts, 28, 4) == [0, 1, 0, 1]


def restart(starts, begin, length):
    return packing.restart_positions(starts, begin, length).tolist()


@pytest.mark.quick
def test_packed_text_blocks_carry_position_ids_only_with_the_document_mask():
    _, _, masked = build(["--data_files", SYNTHETIC, "--seq_len", "64"])
    _, _, unmasked = build(["--data_files", SYNTHETIC, "--seq_len", "64", "--document_mask", "false"])
    eos = build_tokenizer(parse_train([])).eos_token_id
    for index in range(50):
        item, plain = masked.train[index], unmasked.train[index]
        assert torch.equal(item["input_ids"], plain["input_ids"]) and torch.equal(item["labels"], plain["labels"])
        assert "position_ids" not in plain
        # the byte tokenizer has no BOS: a document starts right after an EOS
        after_eos = [i for i in range(1, 64) if item["input_ids"][i - 1] == eos]
        assert [i for i in range(1, 64) if item["position_ids"][i] == 0] == after_eos
        assert item["position_ids"][0] == 0


@pytest.mark.quick
def test_streamed_blocks_carry_the_same_position_ids(tmp_path):
    from train_extras.data.at_scale import StreamedBlocks

    cfg = parse_train(["--data_files", SYNTHETIC, "--seq_len", "64", "--streaming", "--eval_data_files", SYNTHETIC])
    tokenizer = build_tokenizer(cfg)
    blocks = [b for _, b in zip(range(40), StreamedBlocks(cfg, tokenizer, rank=0, world_size=1))]
    eos = tokenizer.eos_token_id
    for block in blocks:
        after_eos = [i for i in range(1, 64) if block["input_ids"][i - 1] == eos]
        assert [i for i in range(1, 64) if block["position_ids"][i] == 0] == after_eos
        assert torch.equal(block["position_ids"][1:] - block["position_ids"][:-1] == 1,
                           torch.tensor([i + 1 not in after_eos for i in range(63)]))


KEPT_APART = {  # transformers 5 builds their mask from position ids: documents kept apart
    "llama": lambda: LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64, vocab_size=100),
    "qwen2": lambda: Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=64, vocab_size=100),
    "gpt2": lambda: GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, bos_token_id=0, eos_token_id=0),
}
NOT_KEPT_APART = {  # BLOOM: ALiBi, no position ids; OPT takes them and still lets documents see each other
    "bloom": lambda: BloomConfig(hidden_size=32, n_layer=2, n_head=2, vocab_size=100),
    "opt": lambda: OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64, vocab_size=100,
                             word_embed_proj_dim=32, bos_token_id=0, eos_token_id=0, pad_token_id=1),
}


@pytest.mark.quick
@pytest.mark.parametrize("family", [*KEPT_APART, *NOT_KEPT_APART])
def test_a_model_that_cannot_keep_documents_apart_is_refused_by_true_and_unmasked_by_auto(family):
    """Asked of the model (train_extras/document_mask.py; the 2025-2026 families: test_document_mask.py)."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config({**KEPT_APART, **NOT_KEPT_APART}[family]())
    accelerator = Accelerator(cpu=True)
    auto = document_mask.resolve(model, accelerator, parse_train([]), 100, None)
    assert model.training  # left as it was
    if family in KEPT_APART:
        assert auto == ("position_ids", None)
        assert document_mask.resolve(model, accelerator, parse_train(["--document_mask", "true"]), 100, None) == auto
    else:
        name = type(model.config).__name__.removesuffix("Config")
        assert auto[0] == "none" and auto[1].startswith(f"{name} does not keep packed documents apart: the second of "
                                                        "two packed documents moved by "), auto
        with pytest.raises(ConfigError, match=f"^--document_mask true: {name} does not keep packed documents apart"):
            document_mask.resolve(model, accelerator, parse_train(["--document_mask", "true"]), 100, None)


def flash_like_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """flash-attention's contract for packed rows, in torch for the CPU: varlen attention over the
    cumulative lengths given (cu_seq_lens_q), or over those found from the position ids of a batch of
    ONE row; several rows without them: plain causal attention per row (their position ids unread)."""
    edges = kwargs.get("cu_seq_lens_q")
    positions = kwargs.get("position_ids")
    if edges is None and query.shape[0] == 1 and positions is not None:
        edges = torch.cat([(positions[0] == 0).nonzero().flatten(), torch.tensor([query.shape[2]])])
    attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, is_causal=True, scale=scaling,
                               enable_gqa=True)
    if edges is None:
        out = attend(query, key, value)
    else:
        edges = edges.tolist()
        out = torch.cat([attend(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b])
                         for a, b in zip(edges, edges[1:])], dim=2)
    return out.transpose(1, 2).contiguous(), None


@pytest.mark.quick
def test_flash_attention_keeps_the_documents_of_several_rows_apart_by_giving_them_as_one():
    """With a kernel that reads packed documents from the position ids of one row only (flash's
    contract, emulated in torch), the probe's two rows find the rows given as one with cumulative
    lengths (SDPA: the position ids alone), and a micro-batch of packed rows then gets the logits
    SDPA gets with the block-diagonal mask."""
    from accelerate import Accelerator
    from transformers import AttentionInterface, AutoModelForCausalLM, masking_utils
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("varlen_like_cpu", flash_like_attention)
    AttentionMaskInterface.register("varlen_like_cpu", masking_utils.flash_attention_mask)
    accelerator = Accelerator(cpu=True)
    models = {}
    for kernel in ("sdpa", "varlen_like_cpu"):
        torch.manual_seed(0)
        models[kernel] = AutoModelForCausalLM.from_config(KEPT_APART["llama"](), attn_implementation=kernel)
    modes = {kernel: document_mask.resolve(model, accelerator, parse_train([]), 100, None)
             for kernel, model in models.items()}
    assert modes == {"sdpa": ("position_ids", None), "varlen_like_cpu": ("position_ids+cu_seq_lens", None)}
    one_row = parse_train(["--micro_batch_size", "1"])  # one row: the position ids alone, as before
    assert document_mask.resolve(models["varlen_like_cpu"], accelerator, one_row, 100, None) == ("position_ids", None)
    ids = torch.randint(0, 100, (3, 24), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([list(range(10)) + list(range(14)), list(range(24)),
                              list(range(5)) + list(range(12)) + list(range(7))])
    logits = {}
    for kernel, model in models.items():
        hooks = document_mask.install(model, accelerator, modes[kernel][0])
        with torch.no_grad():
            logits[kernel] = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for hook in hooks:
            hook.remove()
    assert (logits["varlen_like_cpu"] - logits["sdpa"]).abs().max() < 1e-5
    with torch.no_grad():  # without the rows as one, the kernel lets documents see each other
        plain = models["varlen_like_cpu"](input_ids=ids, position_ids=positions, use_cache=False).logits
    assert (plain - logits["sdpa"]).abs().max() > 1e-2


def test_the_mask_changes_what_trains(train_run, train_run_unmasked):
    """The same 60 steps on the same blocks, with and without document masks: both learn, and the
    losses differ (the toy corpus's documents share blocks of 65 bytes)."""
    masked = [row["loss"] for row in train_run.summary["losses"]]
    unmasked = [row["loss"] for row in train_run_unmasked.summary["losses"]]
    assert len(masked) == len(unmasked) == 60
    assert max(abs(a - b) for a, b in zip(masked, unmasked)) > 1e-3
    assert masked[-1] < masked[0] - 1.0 and unmasked[-1] < unmasked[0] - 1.0
    assert train_run.summary["setup"]["options"]["document_mask"] == "auto"
    assert train_run.summary["setup"]["documents"] == {"mode": "position_ids", "why": None}


# ---- mixtures, in-process ----

def write_mixture(folder, chat_data, weights=(0.8, 0.2), extra="") -> str:
    path = folder / "mixture.yaml"
    path.write_text(f"sources:\n  - name: prose\n    data_files: {SYNTHETIC}\n    weight: {weights[0]}\n"
                    f"  - name: chat\n    data_files: [{chat_data}]\n    weight: {weights[1]}\n{extra}")
    return str(path)


@pytest.mark.quick
def test_documents_are_drawn_by_weight(chat, tmp_path):
    """Over the first 2,000 documents drawn (and over all of them), each source's share is within 3
    points of its weight; the draw is the same every time (the run's seed) and another seed draws
    another order."""
    spec = write_mixture(tmp_path, chat["data"])
    argv = ["--tokenizer_name_or_path", chat["tokenizer"], "--data_mixture", spec, "--seq_len", str(SEQ)]
    cfg, tokenizer, built = build(argv)
    shares = built.facts["mixture"]
    assert sum(s["documents"] for s in shares.values()) >= 2000
    assert shares["prose"]["share"] == pytest.approx(0.8, abs=0.03)
    assert shares["chat"]["share"] == pytest.approx(0.2, abs=0.03)
    # first_exhausted: the prose source (1,960 training documents) was drawn whole, nothing repeats
    assert shares["prose"]["documents"] == shares["prose"]["available"]
    order = mixed_sources(cfg, tokenizer)
    first = np.bincount(order[:2000], minlength=2) / 2000
    assert first == pytest.approx([0.8, 0.2], abs=0.03)
    assert (mixed_sources(cfg, tokenizer) == order).all()
    cfg.seed += 1
    other = mixed_sources(cfg, tokenizer)
    assert len(other) != len(order) or (other != order).any()
    assert set(built.held_out) == {"prose", "chat"} and built.kind == "mixed"
    assert "mixture notice" not in assemble.describe(built.facts)  # chat: most of its documents drawn, none twice


@pytest.mark.quick
def test_a_source_repeated_or_cut_short_by_the_draw_gets_a_notice(tmp_path):
    """A source of 3 documents beside 1,960 (its own held-out file): all_exhausted at weight 0.5%
    draws it 7 times (each document repeated); first_exhausted at 50% ends the epoch after 9
    documents, 6 of the 1,960. The setup block says so with the numbers."""
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"text": f"tiny document number {i}. " * 10}) + "\n" for i in range(3)))
    remedy = ": give the small sources more documents, or change the weights or the stopping_strategy"
    cases = {("0.005", "all_exhausted"): ({"prose": 1960, "tiny": 7}, "'tiny' has 3 training documents and its "
                                          "weight draws 7 of the epoch's 1967: each is repeated, 2.3 times an epoch "
                                          "on average"),
             ("0.5", "first_exhausted"): ({"prose": 6, "tiny": 3}, "'prose' has 1960 training documents and only 6 "
                                          "are drawn an epoch (first_exhausted ends it when 'tiny' runs out)")}
    for (weight, stopping), (drawn, notice) in cases.items():
        spec = tmp_path / "mixture.yaml"
        spec.write_text(f"sources:\n  - name: prose\n    data_files: {SYNTHETIC}\n    weight: 1\n"
                        f"  - name: tiny\n    data_files: {tiny}\n    eval_data_files: {tiny}\n    weight: {weight}\n"
                        f"stopping_strategy: {stopping}\n")
        shares = build(["--data_mixture", str(spec), "--seq_len", "64"])[2].facts["mixture"]
        assert {name: s["documents"] for name, s in shares.items()} == drawn
        assert {name: s["available"] for name, s in shares.items()} == {"prose": 1960, "tiny": 3}
        assert assemble.describe({"mixture": shares})["mixture notice"] == notice + remedy


def mixed_sources(cfg, tokenizer) -> np.ndarray:
    """Which source each drawn document came from, in order (the mixture rebuilt with `cfg`)."""
    import datasets

    captured = {}
    interleave = datasets.interleave_datasets

    def spy(dsets, **kwargs):
        captured["mixed"] = interleave(dsets, **kwargs)
        return captured["mixed"]

    datasets.interleave_datasets = spy
    try:
        assemble.build(cfg, tokenizer)
    finally:
        datasets.interleave_datasets = interleave
    return np.asarray(captured["mixed"]["source"])


@pytest.mark.quick
def test_streaming_is_text_from_one_source(chat, tmp_path):
    spec = write_mixture(tmp_path, chat["data"])
    for extra in (["--data_mixture", spec], ["--data_files", chat["data"], "--eval_data_files", chat["data"],
                                             "--chat_column", "messages"]):
        with pytest.raises(ConfigError, match="--streaming streams text from one source"):
            parse_train(["--streaming", *extra])


@pytest.mark.quick
@pytest.mark.parametrize("content, message", [
    ("sources: []\n", "a non-empty list under 'sources:'"),
    ("sources:\n  - data_files: x.jsonl\n", "source 0 needs a positive 'weight:', got None"),
    ("sources:\n  - data_files: x.jsonl\n    weight: -1\n", "source 0 needs a positive 'weight:', got -1"),
    ("sources:\n  - weight: 1\n", "source 0 needs data_files or dataset_name"),
    ("sources:\n  - data_files: x.jsonl\n    weight: 1\n    colour: red\n", r"unknown option\(s\) \['colour'\]"),
    ("sources:\n  - {data_files: a.jsonl, weight: 1, name: s}\n  - {data_files: b.jsonl, weight: 1, name: s}\n",
     "source names must differ"),
    ("sources:\n  - {data_files: a.jsonl, weight: 1}\nstopping_strategy: never\n", "stopping_strategy must be one"),
    ("sources: [\n", "is not valid YAML"),
])
def test_a_bad_mixture_file_is_one_line(tmp_path, content, message):
    path = tmp_path / "mixture.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        parse_train(["--data_mixture", str(path)])
    assert "\n" not in str(err.value)


@pytest.mark.quick
def test_a_mixture_names_its_own_data_and_its_sources_are_checked(chat, tmp_path):
    spec = write_mixture(tmp_path, chat["data"])
    with pytest.raises(ConfigError, match="names its sources' data options itself: not with --data_files"):
        parse_train(["--data_mixture", spec, "--data_files", SYNTHETIC])
    with pytest.raises(ConfigError, match="cannot read --data_mixture nowhere.yaml"):
        parse_train(["--data_mixture", "nowhere.yaml"])
    missing = write_mixture(tmp_path, tmp_path / "missing.jsonl")
    cfg = parse_train(["--data_mixture", missing, "--tokenizer_name_or_path", chat["tokenizer"]])
    with pytest.raises(ConfigError, match="--data_mixture source 'chat': data file not found: .*missing.jsonl"):
        assemble.build(cfg, build_tokenizer(cfg))


# ---- launched: conversations and a mixture, trained and resumed ----

CHAT_ARGS = ["--preset", "debug", "--seq_len", str(SEQ), "--micro_batch_size", "8", "--max_steps", "40",
             "--warmup_steps", "2", "--lr", "3e-3", "--eval_every", "20", "--log_every", "10", "--save_every", "20",
             "--sample_length", "16"]


@pytest.fixture(scope="module")
def chat_runs(tmp_path_factory, hf_home, chat):
    """40 steps on the conversations (packed, document masks), then the same run resumed at step 20."""
    out = tmp_path_factory.mktemp("chat_run")
    args = CHAT_ARGS + ["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", chat["data"]]
    full = Run(out, launch("train.py", args + ["--output_dir", str(out)], hf_home))
    again = tmp_path_factory.mktemp("chat_resumed")
    resumed = Run(again, launch("train.py", args + ["--output_dir", str(again), "--resume_from_checkpoint",
                                                    str(out / "checkpoints" / "step_20")], hf_home))
    return full, resumed


def test_a_run_on_conversations_learns_resumes_exactly_and_samples_an_answer(chat_runs, chat):
    full, resumed = chat_runs
    summary = full.summary
    assert summary["data"]["kind"] == "conversations"
    assert summary["data"]["conversations"]["dropped_overlong"] > 0
    assert "conversations    : " in full.proc.stdout and "dropped overlong" in full.proc.stdout
    assert "\ndocuments        : kept apart (position ids)\n" in full.proc.stdout
    losses = [row["loss"] for row in summary["losses"]]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 1.5, summary["eval"]
    check_exact_resume(full, resumed, 20)
    sample = summary["samples"][-1]
    tokenizer = AutoTokenizer.from_pretrained(chat["tokenizer"])
    assert sample["prompt"] == render.sample_prompt(tokenizer, summary["setup"]["options"]["sample_message"])
    assert sample["prompt"].endswith("<|assistant|>\n")
    # the export keeps the template, so the exported folder renders conversations as the run did
    exported = AutoTokenizer.from_pretrained(summary["export"])
    assert exported.chat_template == tokenizer.chat_template
    saved = checkpoint.verify(full.output_dir / "checkpoints" / "step_20", contents=False)
    assert saved["data"]["chat_template_sha256"] is not None


@pytest.fixture(scope="module")
def mixture_runs(tmp_path_factory, hf_home, chat):
    """A mixture of prose (0.8) and conversations (0.2): 40 steps, then resumed at step 20."""
    folder = tmp_path_factory.mktemp("mixture")
    spec = write_mixture(folder, chat["data"])
    args = CHAT_ARGS + ["--tokenizer_name_or_path", chat["tokenizer"], "--data_mixture", spec]
    out = folder / "full"
    full = Run(out, launch("train.py", args + ["--output_dir", str(out)], hf_home))
    again = folder / "resumed"
    resumed = Run(again, launch("train.py", args + ["--output_dir", str(again), "--resume_from_checkpoint",
                                                    str(out / "checkpoints" / "step_20")], hf_home))
    return full, resumed, spec


def test_a_mixture_logs_each_sources_held_out_loss_and_resumes_exactly(mixture_runs):
    full, resumed, _ = mixture_runs
    evals = full.summary["eval"]
    assert [e["step"] for e in evals] == [0, 20, 40]
    for result in evals:
        sources = result["sources"]
        assert set(sources) == {"prose", "chat"}
        tokens = sum(s["tokens"] for s in sources.values())
        assert result["tokens"] == tokens
        assert result["loss"] == pytest.approx(sum(s["loss"] * s["tokens"] for s in sources.values()) / tokens)
    for name in ("prose", "chat"):
        assert evals[-1]["sources"][name]["loss"] < evals[0]["sources"][name]["loss"] - 1.0, evals
    rows = [json.loads(line) for line in (full.output_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if row["kind"] == "eval"]
    assert [row["sources"] for row in logged] == [e["sources"] for e in evals]
    shares = full.summary["data"]["mixture"]
    assert shares["prose"]["share"] == pytest.approx(0.8, abs=0.03)
    assert "mixture          : prose 79.9% of 2453 documents (weight 80.0%" in full.proc.stdout
    check_exact_resume(full, resumed, 20)
    # the same weights at step 40: the same held-out losses, source by source
    assert [e["sources"] for e in resumed.summary["eval"]] == [evals[-1]["sources"]]


def test_an_edited_mixture_is_refused_on_resume(mixture_runs, chat, tmp_path):
    full, _, spec = mixture_runs
    saved = checkpoint.verify(full.output_dir / "checkpoints" / "step_20", contents=False)
    cfg = parse_train(["--data_mixture", spec])
    checkpoint.check_same_data(tmp_path, saved, {**saved["data"], "mixture": sources.identity(cfg)})
    edited = write_mixture(tmp_path, chat["data"], weights=(0.7, 0.3))
    edited_identity = sources.identity(parse_train(["--data_mixture", edited]))
    with pytest.raises(ConfigError, match="its data mixture was another"):
        checkpoint.check_same_data(tmp_path, saved, {**saved["data"], "mixture": edited_identity})


# ---- launched: the document mask under cpu.yaml, ddp.yaml and fsdp.yaml ----

@pytest.mark.parametrize("config", ["cpu.yaml", "ddp.yaml", "fsdp.yaml"])
def test_a_later_document_does_not_see_an_earlier_one(config, tmp_path, hf_home):
    """B's logits are unchanged when A's tokens change (bitwise here; 1e-6 asked), and change
    without the document mask; A's own logits change either way (the change reaches the model)."""
    out = tmp_path / "result.json"
    script = ROOT / "tests" / "scripts" / "document_mask.py"
    args = [str(out), "--preset", "debug", "--data_files", SYNTHETIC, "--seq_len", "64",
            "--output_dir", str(tmp_path / "run")]
    if config == "cpu.yaml":
        launch("train.py", args, hf_home, recipe_path=script)
    else:
        launch_two_processes("train.py", config, args, hf_home, recipe_path=script)
    result = json.loads(out.read_text())
    masked, unmasked = result["masked"], result["unmasked"]
    assert masked["has_position_ids"] and not unmasked["has_position_ids"]
    assert masked["b_max_change"] <= 1e-6, result
    assert unmasked["b_max_change"] > 1e-2, result
    assert masked["a_max_change"] > 1e-2 and unmasked["a_max_change"] > 1e-2, result


def test_conversations_under_fsdp_train_as_one_process(chat_runs, chat, tmp_path, hf_home):
    """FSDP2 on 2 ranks, 4 conversations' blocks each (the same global batch of 8): the ranks hold
    different numbers of assistant tokens, and the loss is still normalised by the step's total, so
    every step equals the 1-process run's."""
    full, _ = chat_runs
    args = CHAT_ARGS + ["--tokenizer_name_or_path", chat["tokenizer"], "--data_files", chat["data"],
                        "--micro_batch_size", "4", "--save_every", "0", "--sample_length", "0",
                        "--output_dir", str(tmp_path)]
    run = Run(tmp_path, launch_two_processes("train.py", "fsdp.yaml", args, hf_home))
    assert run.summary["setup"]["distributed_type"] == "FSDP"
    reference = [row["loss"] for row in full.summary["losses"]]
    assert [row["loss"] for row in run.summary["losses"]] == pytest.approx(reference, abs=1e-4, rel=0)
    assert [e["loss"] for e in run.summary["eval"]] == pytest.approx([e["loss"] for e in full.summary["eval"]],
                                                                      abs=1e-4, rel=0)
