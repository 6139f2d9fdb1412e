"""Write a diffusers pipeline folder as one A1111 / ComfyUI (LDM layout) ``.safetensors`` file, for tests.

The inverse of what diffusers' ``from_single_file`` reads, computed from the UNet/VAE configs (any number of
levels and layers, so the tiny architectures work too):

    UNet   conv_in -> input_blocks.0.0; level i, layer j -> input_blocks.{1 + i(n+1) + j}.{0 resnet, 1 attention};
           downsampler -> input_blocks.{(i+1)(n+1)}.0.op; mid -> middle_block.{0,1,2};
           up level i, layer j (n+1 layers) -> output_blocks.{i(n+1) + j}.{0 resnet, 1 attention}, the upsampler
           after them in the level's last block;
           resnet norm1/conv1/norm2/conv2/time_emb_proj/conv_shortcut -> in_layers.0/2, out_layers.0/3,
           emb_layers.1, skip_connection
    VAE    down_blocks.i.resnets.j -> down.i.block.j; up_blocks.i -> up.{L-1-i}; mid resnets -> mid.block_{1,2};
           mid attention -> mid.attn_1 with norm/q/k/v/proj_out as 1x1 convolutions
    CLIP   cond_stage_model.transformer.text_model.* (SD 1.x) / conditioner.embedders.0.transformer.text_model.*
    OpenCLIP  q/k/v -> in_proj (concatenated), fc1/fc2 -> mlp.c_fc/c_proj, text_projection transposed
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(f))
    return out


def _unet_map(cfg: dict) -> list[tuple[str, str]]:
    """(diffusers prefix, LDM prefix) pairs, most specific first."""
    levels, n = len(cfg["block_out_channels"]), cfg["layers_per_block"]
    pairs = [("time_embedding.linear_1.", "time_embed.0."), ("time_embedding.linear_2.", "time_embed.2."),
             ("add_embedding.linear_1.", "label_emb.0.0."), ("add_embedding.linear_2.", "label_emb.0.2."),
             ("conv_in.", "input_blocks.0.0."), ("conv_norm_out.", "out.0."), ("conv_out.", "out.2.")]
    for i in range(levels):
        for j in range(n):
            pairs.append((f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{1 + i * (n + 1) + j}.0."))
            pairs.append((f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{1 + i * (n + 1) + j}.1."))
        pairs.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(i + 1) * (n + 1)}.0.op."))
        has_attn = "CrossAttn" in cfg["up_block_types"][i]
        for j in range(n + 1):
            pairs.append((f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{i * (n + 1) + j}.0."))
            pairs.append((f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{i * (n + 1) + j}.1."))
        pairs.append((f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{i * (n + 1) + n}.{2 if has_attn else 1}."))
    pairs += [("mid_block.resnets.0.", "middle_block.0."), ("mid_block.attentions.0.", "middle_block.1."),
              ("mid_block.resnets.1.", "middle_block.2.")]
    return pairs


_RESNET = [("norm1.", "in_layers.0."), ("conv1.", "in_layers.2."), ("norm2.", "out_layers.0."),
           ("conv2.", "out_layers.3."), ("time_emb_proj.", "emb_layers.1."), ("conv_shortcut.", "skip_connection.")]


def _rename(key: str, pairs: list[tuple[str, str]]) -> tuple[str, str, str]:
    """(diffusers prefix, LDM prefix, the rest) of a diffusers key, by the longest matching prefix."""
    for hf, ldm in sorted(pairs, key=lambda p: -len(p[0])):
        if key.startswith(hf):
            return hf, ldm, key[len(hf):]
    raise KeyError(key)


def unet_to_ldm(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    pairs = _unet_map(cfg)
    out = {}
    for key, value in sd.items():
        hf, prefix, rest = _rename(key, pairs)
        if ".resnets." in hf:
            for name, ldm in _RESNET:
                if rest.startswith(name):
                    rest = ldm + rest[len(name):]
                    break
        out["model.diffusion_model." + prefix + rest] = value
    return out


def vae_to_ldm(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    levels = len(cfg["block_out_channels"])
    pairs = []
    for i in range(levels):
        pairs.append((f"encoder.down_blocks.{i}.resnets.", f"encoder.down.{i}.block."))
        pairs.append((f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample."))
        pairs.append((f"decoder.up_blocks.{i}.resnets.", f"decoder.up.{levels - 1 - i}.block."))
        pairs.append((f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{levels - 1 - i}.upsample."))
    for part in ("encoder", "decoder"):
        pairs += [(f"{part}.mid_block.resnets.0.", f"{part}.mid.block_1."),
                  (f"{part}.mid_block.resnets.1.", f"{part}.mid.block_2."),
                  (f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1."),
                  (f"{part}.conv_norm_out.", f"{part}.norm_out.")]
    attn = [("group_norm.", "norm."), ("to_q.", "q."), ("to_k.", "k."), ("to_v.", "v."), ("to_out.0.", "proj_out.")]
    out = {}
    for key, value in sd.items():
        new = key
        for hf, ldm in pairs:
            if key.startswith(hf):
                new = ldm + key[len(hf):]
                break
        new = new.replace(".conv_shortcut.", ".nin_shortcut.")
        if ".mid.attn_1." in new:
            head, rest = new.split(".mid.attn_1.")
            for hf, ldm in attn:
                if rest.startswith(hf):
                    rest = ldm + rest[len(hf):]
            new = f"{head}.mid.attn_1.{rest}"
            if value.ndim == 2:
                value = value.reshape(*value.shape, 1, 1)
        out["first_stage_model." + new] = value
    return out


def _text_model(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys with the ``text_model.`` prefix (transformers 5 may save CLIPTextModel flattened)."""
    return {(k if k.startswith(("text_model.", "text_projection")) else "text_model." + k): v for k, v in sd.items()}


def clip_to_ldm(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + k: v for k, v in _text_model(sd).items() if not k.endswith("position_ids")}


def openclip_to_ldm(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    parts = [("layer_norm1.", "ln_1."), ("layer_norm2.", "ln_2."), ("mlp.fc1.", "mlp.c_fc."),
             ("mlp.fc2.", "mlp.c_proj."), ("self_attn.out_proj.", "attn.out_proj.")]
    for key, value in _text_model(sd).items():
        if key == "text_projection.weight":
            out[prefix + "text_projection"] = value.T.contiguous()
        elif key == "text_model.embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = value
        elif key == "text_model.embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = value
        elif key.startswith("text_model.final_layer_norm."):
            out[prefix + "ln_final." + key.rsplit(".", 1)[1]] = value
        elif key.startswith("text_model.encoder.layers."):
            index, rest = key[len("text_model.encoder.layers."):].split(".", 1)
            block = f"{prefix}transformer.resblocks.{index}."
            if rest.startswith("self_attn.") and rest.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
                _, proj, kind = rest.split(".")
                qkv.setdefault(f"{block}attn.in_proj_{kind}", {})[proj] = value
                continue
            for hf, ldm in parts:
                if rest.startswith(hf):
                    rest = ldm + rest[len(hf):]
            out[block + rest] = value
    for key, d in qkv.items():
        out[key] = torch.cat([d["q_proj"], d["k_proj"], d["v_proj"]])
    return out


def write_single_file(folder: Path, out: Path) -> Path:
    """``folder`` (a diffusers SD / SDXL pipeline folder) as one LDM-layout safetensors file ``out``."""
    index = json.loads((folder / "model_index.json").read_text())
    unet_cfg = json.loads((folder / "unet" / "config.json").read_text())
    vae_cfg = json.loads((folder / "vae" / "config.json").read_text())
    state = {**unet_to_ldm(_weights(folder / "unet"), unet_cfg), **vae_to_ldm(_weights(folder / "vae"), vae_cfg)}
    te = _weights(folder / "text_encoder")
    if index["_class_name"] == "StableDiffusionXLPipeline":
        state.update(clip_to_ldm(te, "conditioner.embedders.0.transformer."))
        state.update(openclip_to_ldm(_weights(folder / "text_encoder_2"), "conditioner.embedders.1.model."))
    elif json.loads((folder / "text_encoder" / "config.json").read_text()).get("hidden_act") == "gelu":
        state.update(openclip_to_ldm(te, "cond_stage_model.model."))  # SD 2.x: OpenCLIP-H
    else:
        state.update(clip_to_ldm(te, "cond_stage_model.transformer."))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out))
    return out
