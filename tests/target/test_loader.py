"""The drafter's MASK token (a row the target never emits) and the last-layer convention."""

from __future__ import annotations

import pytest
import torch

from cache_format.schema import last_layer_refusal
from target.loader import capture, choose_mask_token, decoder_parts, mask_token_of, stack_upto
from tests.helpers import make_manifest, tiny_target_dir, tiny_tokenizer


def test_the_first_padding_row_when_the_embedding_has_more_rows_than_the_tokenizer():
    # Qwen3: 151,669 tokens, 151,936 rows -> 151669, the id DFlash's published Qwen3 drafters use
    assert choose_mask_token(vocab_size=151936, tokenizer_size=151669, special={151643: "<|endoftext|>"},
                             avoid=set()) == (151669, "")


def test_else_the_highest_unused_special_token():
    special = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 5: "<file_sep>", 16: "<empty_output>"}
    assert choose_mask_token(vocab_size=100, tokenizer_size=100, special=special, avoid={0, 1, 2}) == (16, "<empty_output>")
    assert choose_mask_token(vocab_size=100, tokenizer_size=100, special=special, avoid={0, 1, 2, 16}) == (5, "<file_sep>")
    with pytest.raises(ValueError, match="--mask-token-id"):
        choose_mask_token(vocab_size=100, tokenizer_size=100, special=special, avoid=set(special))


def test_a_tokenizer_without_padding_rows_gets_a_special_token_its_chat_template_never_writes():
    tok = tiny_tokenizer()  # 300 tokens; specials 0 <|endoftext|> (pad), 1 <|im_start|> (bos), 2 <|im_end|> (eos)
    assert mask_token_of(tok, 320) == (300, "")
    with pytest.raises(ValueError, match="no token the target never emits"):
        mask_token_of(tok, 300)  # every special token is eos, bos, pad or in the chat template
    tok.add_special_tokens({"additional_special_tokens": ["<unused>"]})
    assert mask_token_of(tok, 301) == (300, "<unused>")


def test_the_manifest_refuses_the_last_layer_and_a_mask_outside_the_vocabulary():
    make_manifest(layer_ids=(0, 2))  # 4 layers: 2 is fine
    with pytest.raises(ValueError, match="layer id 3 is the target's last layer.*up to 2"):
        make_manifest(layer_ids=(0, 3))
    assert "after the final norm" in last_layer_refusal(4)
    with pytest.raises(ValueError, match="mask_token_id 100 is outside"):
        make_manifest(mask_token_id=100)
    for ids, msg in (((0, 4), r"layer id 4 out of range: target has 4 layers \(0\.\.3\)"), ((1, 1), "duplicates"),
                     ((-1,), "layer id -1 out of range"), ((), "must not be empty")):
        with pytest.raises(ValueError, match=msg):
            make_manifest(layer_ids=ids)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_stack_cut_above_the_last_tap_gives_the_same_taps_and_runs_no_higher_layer(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir(tmp_path / "t", arch, num_layers=6)).eval()
    _, layers, _ = decoder_parts(model)
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(layers)]
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states  # [embeddings, layer 0 out, ...]
        ran.clear()
        with capture(model, [0, 3]) as taps, stack_upto(model, 3):
            model.model(input_ids=ids)
    assert ran == [0, 1, 2, 3]
    for lid in (0, 3):
        assert torch.equal(taps[lid], hs[lid + 1])
    assert decoder_parts(model)[1] is layers and len(layers) == 6  # the whole stack again afterwards
    with stack_upto(model, 5):  # the last layer: nothing to cut
        assert decoder_parts(model)[1] is layers
    for h in hooks:
        h.remove()
