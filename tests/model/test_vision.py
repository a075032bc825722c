"""The vision encoder and image rows in the forward: what the encoder computes, that its vectors
replace the image tokens' embeddings at exactly their rows (alone, in any cut, in any batch), and
what a checkpoint with an encoder must hold."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shared.images import image_spec_of
from tests.checkpoints import add_vision, save_hf
from worker.model import weights_digest
from worker.model.checkpoint import CheckpointError, load_checkpoint
from worker.model.config import ConfigError
from worker.model.dense import DenseConfig, build_dense
from worker.model.state import Embeds
from worker.model.vision import PromptEmbeds, VisionConfig, encode_images, image_spec
from worker.model.weights import WeightsError

IMG = 255
BLOCK = 16


@pytest.fixture(scope="module")
def vlm():
    return build_dense(DenseConfig(vision=VisionConfig(), image_token_id=IMG), seed=3)


def pixels(seed: int, size: int = 32) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8).tobytes()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_the_patch_embedding_is_a_stride_p_convolution_over_normalised_pixels(vlm) -> None:
    enc, px = vlm.vision, pixels(1)
    hwc = torch.frombuffer(bytearray(px), dtype=torch.uint8).view(32, 32, 3)
    x = hwc.permute(2, 0, 1).float()[None] / 127.5 - 1.0
    w = enc.patch_embed.weight.view(enc.cfg.hidden_size, 3, 8, 8)
    conv = F.conv2d(x, w, enc.patch_embed.bias, stride=8)[0].flatten(1).T        # [patches, hidden], row-major
    ours = enc.patch_embed(enc.patches(hwc))
    assert torch.allclose(ours, conv, atol=1e-5)
    (v,) = encode_images(vlm, [px])
    assert v.shape == (16, 64) and v.dtype == vlm.dtype
    assert torch.equal(bits(v), bits(encode_images(vlm, [px])[0]))          # the same bits every time
    with pytest.raises(ValueError, match="uint8"):
        enc(torch.zeros(32, 32, 3))
    with pytest.raises(ValueError, match="32×32×3 bytes"):
        encode_images(vlm, [pixels(1, 16)])


def test_image_vectors_replace_the_image_rows_in_any_cut_and_any_batch(vlm) -> None:
    (v,) = encode_images(vlm, [pixels(2)])
    toks = list(range(20)) + [IMG] * 16 + list(range(40, 70))
    # one forward over the whole prompt, the override built by hand
    state = vlm.new_state(BLOCK, 80)
    whole = vlm.forward_batch([(toks, state, Embeds(torch.arange(20, 36), v))], logits="all")[0]
    # the prefill schedule in one-block units (the image cut at 32), the override cut per unit
    cut = vlm.prefill(toks, vlm.new_state(BLOCK, 80), embeds=PromptEmbeds([(20, v)]))
    assert torch.equal(bits(whole), bits(cut))
    plain = vlm.prefill(toks, vlm.new_state(BLOCK, 80))
    assert torch.equal(bits(plain[:20]), bits(whole[:20]))      # rows before the image: unchanged
    assert not torch.equal(plain[20:], whole[20:])               # from the image on: its vectors count
    # batched with a text request, the image request and the text request keep their bits
    other = list(range(100, 123))
    sa, sb = vlm.new_state(BLOCK, 80), vlm.new_state(BLOCK, 80)
    a, b = vlm.forward_batch([(other, sa), (toks, sb, Embeds(torch.arange(20, 36), v))], logits="all")
    assert torch.equal(bits(b), bits(whole))
    assert torch.equal(bits(a), bits(vlm.extend(other, vlm.new_state(BLOCK, 80))))
    with pytest.raises(ValueError, match="rows outside"):
        vlm.forward_batch([(toks[:10], vlm.new_state(BLOCK, 80), Embeds(torch.arange(8, 12), v[:4]))])


def test_vision_weights_are_in_the_seeded_weights_digest(vlm) -> None:
    changed = build_dense(DenseConfig(vision=VisionConfig(), image_token_id=IMG), seed=3)
    assert weights_digest(changed) == weights_digest(vlm)
    with torch.no_grad():
        changed.vision.proj_out.bias[0] += 1
    assert weights_digest(changed) != weights_digest(vlm)


def test_a_config_pairs_the_encoder_with_its_token() -> None:
    with pytest.raises(ConfigError, match="go together"):
        DenseConfig(vision=VisionConfig())
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        DenseConfig(vision=VisionConfig(), image_token_id=256)
    with pytest.raises(ConfigError, match="multiple of vision.patch_size"):
        VisionConfig(image_size=30, patch_size=8)
    with pytest.raises(ConfigError, match="only 3"):
        VisionConfig(num_channels=1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return save_hf("llama", tmp_path_factory.mktemp("vlm") / "ckpt", seed=2, vocab_size=256)


def test_a_checkpoint_with_a_vision_encoder_loads_and_its_files_are_its_identity(llama_dir, tmp_path) -> None:
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    text_only = load_checkpoint(d).model
    assert image_spec(text_only) is None and image_spec_of(str(d)) is None
    add_vision(d, image_token_id=200, image_size=16, patch_size=4, hidden_size=24)
    m = load_checkpoint(d).model
    spec = image_spec(m)
    assert spec == image_spec_of(str(d)) and (spec.image_size, spec.patch_size, spec.image_token_id) == (16, 4, 200)
    assert spec.tokens_per_image == 16 and encode_images(m, [pixels(1, 16)])[0].shape == (16, 64)
    # the directory's digest (the namespace's) covers the encoder's config and weights
    assert m.checkpoint_digest != text_only.checkpoint_digest
    add_vision(d, image_token_id=200, image_size=16, patch_size=4, hidden_size=24, seed=1)   # other weights
    assert load_checkpoint(d).model.checkpoint_digest != m.checkpoint_digest


def _edit(d, **changes) -> None:
    doc = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            doc.pop(k, None)
        else:
            doc[k] = v
    (d / "config.json").write_text(json.dumps(doc))


def test_a_checkpoint_the_loader_cannot_run_is_refused_by_name(llama_dir, tmp_path) -> None:
    import shutil
    d = tmp_path / "ckpt"
    shutil.copytree(llama_dir, d)
    add_vision(d, image_token_id=200)
    vision = json.loads((d / "config.json").read_text())["vision"]
    _edit(d, vision={**vision, "layers": 2})
    with pytest.raises(CheckpointError, match="vision.layers"):
        load_checkpoint(d)
    _edit(d, vision=vision, image_token_id=None)
    with pytest.raises(CheckpointError, match="go together"):
        load_checkpoint(d)
    _edit(d, vision=None)                                   # weights without the config: unexpected tensors
    with pytest.raises(WeightsError, match="unexpected.*vision"):
        load_checkpoint(d)
    _edit(d, vision=vision, image_token_id=200)
    (d / "vision.safetensors").unlink()                     # the config without the weights: missing tensors
    with pytest.raises(WeightsError, match="missing.*vision"):
        load_checkpoint(d)
