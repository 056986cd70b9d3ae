"""The built-in demo model, and random models of any shape for tests and benchmarks.

The demo (`write_demo_model`) is a tiny qwen3_moe trained on fortune cookies by
tools/train_demo.py and shipped in storage/demo_model/ (bf16 safetensors, its own BPE
tokenizer, a ChatML chat template, and training.json: corpus, licence, command, loss
curve, routing statistics, the checkpoint's sha256). It writes English and routes like a
trained model; it is not a useful assistant.

`write_random_model` writes a deterministic, randomly initialised qwen3_moe of any shape
(byte-level tokenizer): its text is not language (the LM head only prefers printable
ASCII), but its size and layout can be chosen, as the memory test and the benchmarks need.
Nothing is downloaded.
"""

import json
import os
import shutil
import tempfile

import numpy as np

from .safetensors import SafetensorsWriter, f32_to_bf16

SEED = 20261130
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 256 + len(SPECIALS),
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": None,
    "eos_token_id": 258,
    "torch_dtype": "bfloat16",
}


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # the byte-level alphabet in byte order (GPT-2's bytes_to_unicode), so token id = byte value
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok.to_str()


def _tensors(cfg: dict) -> list[tuple[str, tuple, str]]:
    """(name, shape, kind) of every tensor, kind one of embed, norm, head, matrix, router."""
    D, V, hd = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    Hq, Hkv, E, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["moe_intermediate_size"]
    out = [("model.embed_tokens.weight", (V, D), "embed"), ("model.norm.weight", (D,), "norm"),
           ("lm_head.weight", (V, D), "head")]
    for il in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{il}."
        out += [(p + "input_layernorm.weight", (D,), "norm"), (p + "post_attention_layernorm.weight", (D,), "norm"),
                (p + "self_attn.q_proj.weight", (Hq * hd, D), "matrix"),
                (p + "self_attn.k_proj.weight", (Hkv * hd, D), "matrix"),
                (p + "self_attn.v_proj.weight", (Hkv * hd, D), "matrix"),
                (p + "self_attn.o_proj.weight", (D, Hq * hd), "matrix"),
                (p + "self_attn.q_norm.weight", (hd,), "norm"), (p + "self_attn.k_norm.weight", (hd,), "norm"),
                (p + "mlp.gate.weight", (E, D), "router")]
        for ie in range(E):
            q = f"{p}mlp.experts.{ie}."
            out += [(q + "gate_proj.weight", (I, D), "matrix"), (q + "up_proj.weight", (I, D), "matrix"),
                    (q + "down_proj.weight", (D, I), "matrix")]
    return out


def _value(i: int, shape: tuple, kind: str) -> np.ndarray:
    """Tensor i's values (bf16 bits), from its own seeded generator: deterministic, one at a time."""
    rng = np.random.default_rng([SEED, i])
    x = rng.standard_normal(shape, dtype=np.float32)
    if kind == "norm":
        return f32_to_bf16(1 + 0.1 * x)
    if kind == "embed":
        return f32_to_bf16(x)
    scale = shape[-1] ** -0.5 * {"matrix": 1.0, "router": 2.0, "head": 4.0}[kind]
    if kind == "head":  # random logits for printable ASCII, 0 for the rest
        x[np.r_[0:32, 127 : shape[0]]] = 0
    return f32_to_bf16(x * scale)


def write_weights(path: str, cfg: dict) -> None:
    """Write the random weights of `cfg` as one safetensors file, a tensor at a time."""
    specs = _tensors(cfg)
    w = SafetensorsWriter(path, [(n, "BF16", shape) for n, shape, _ in specs], {"format": "pt"})
    for i, (_, shape, kind) in enumerate(specs):
        w.write(_value(i, shape, kind))
    w.close()


DEMO_DIR = os.path.join(os.path.dirname(__file__), "demo_model")
DEMO_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "training.json")


def write_demo_model(path: str, force: bool = False) -> str:
    """Write the built-in demo checkpoint to `path` (copied into a temporary directory
    next to it, then renamed, so a half-written model never looks whole). Returns the path.

    Raises FileExistsError if path exists and is not empty, unless force; OSError.
    """
    tmp, path = _fresh(path, force)
    try:
        for name in DEMO_FILES:
            shutil.copyfile(os.path.join(DEMO_DIR, name), os.path.join(tmp, name))
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _fresh(path: str, force: bool) -> tuple[str, str]:
    """(a temporary directory next to `path`, path made absolute), the old path removed
    with force. Raises FileExistsError."""
    path = os.path.abspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        if not force:
            raise FileExistsError(f"{path} exists and is not empty")
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=".demo-", dir=parent), path


def _publish(tmp: str, path: str) -> None:
    if os.path.isdir(path):
        os.rmdir(path)
    os.rename(tmp, path)


def write_random_model(path: str, force: bool = False, **overrides) -> str:
    """Write a random qwen3_moe checkpoint (CONFIG with `overrides`) to `path`, the same
    way. Returns the path. Raises FileExistsError if path exists and is not empty, unless
    force.
    """
    tmp, path = _fresh(path, force)
    try:
        cfg = CONFIG | overrides
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": [258, 256], "do_sample": False}, f, indent=2)
        with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
            f.write(_tokenizer_json())
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                       "chat_template": CHAT_TEMPLATE, "model_max_length": cfg["max_position_embeddings"]}, f,
                      indent=2)
        write_weights(os.path.join(tmp, "model.safetensors"), cfg)
        _publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def default_demo_path(state_dir: str | None = None) -> str:
    """The one place of the demo model, for the daemon and `colictl run` alike: demo-model
    in the state directory (`state_dir`, else $STATE_DIRECTORY, else ~/.local/state/colibri)."""
    from .statefile import default_state_dir

    return os.path.join(state_dir or default_state_dir(), "demo-model")


def ensure_demo_container(path: str, build, progress=None) -> str:
    """The demo model as a container at `path` (written, then converted, the first time;
    anything else there, e.g. the demo of an older colibri, is replaced), so that every
    command of the daemon's walkthrough (cache, pin, policy) works on it. `demo-source` in
    it names the shipped weights it was made from. `build(path, config)` is the engine's
    registry (placement.py), which knows the family's expert tensor names. `progress(phase)`
    hears each step. Returns the path. Raises OSError."""
    from .checkpoint import load_config, open_checkpoint
    from .container import is_container
    from .convert import convert, plan_for

    path = os.path.abspath(path)
    with open(os.path.join(DEMO_DIR, "training.json")) as f:
        source = json.load(f)["model_safetensors_sha256"]
    try:
        with open(os.path.join(path, "demo-source")) as f:
            if is_container(path) and f.read() == source:
                return path
    except OSError:
        pass
    os.makedirs(os.path.dirname(path), exist_ok=True)
    src = tempfile.mkdtemp(prefix=".demo-checkpoint-", dir=os.path.dirname(path))
    try:
        if progress:
            progress("writing the demo model")
        write_demo_model(src, force=True)
        if progress:
            progress("converting the demo model to a container")
        model = build(src, load_config(src))
        convert(model.source(open_checkpoint(src)), path,
                plan_for(model), force=True)
        with open(os.path.join(path, "demo-source"), "w") as f:
            f.write(source)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return path
