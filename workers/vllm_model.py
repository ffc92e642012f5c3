"""A small random-initialised Hugging Face model directory that vLLM loads, written locally.

Run by the vLLM venv's Python (`testbed models --write DIR` starts it as a subprocess: the
testbed's venv has no transformers), never imported by a worker. Nothing is downloaded:

- `config.json` + `model.safetensors`: a dense Llama with grouped-query attention (vLLM's
  `LlamaForCausalLM`, supported on CPU), weights drawn from a seeded normal, saved in float32
  so that a `--dtype float32` server computes (and ships) exactly these values;
- a tokenizer built locally: a word-level vocabulary `t0 .. t{V-1}` (whitespace split),
  wrapped in `PreTrainedTokenizerFast`. The testbed sends prompts as token ids, so the
  tokenizer only has to exist (vLLM loads one at start-up) and to round-trip ids.

KV bytes per token: layers x kv_heads x head_dim x 2 (K, V) x dtype bytes; the default
(4 x 2 x 64 x 2 x 4 B in float32) is 4,096 B/token. Printed as one JSON line on success.

`--arch qwen3_next` writes a hybrid instead (vLLM's `Qwen3NextForCausalLM`, no experts): three Gated DeltaNet
(linear attention) layers to one full-attention layer, the same widths, in bfloat16, because
vLLM's CPU kernels for Gated DeltaNet take bf16 only (docs/vllm.md, "Hybrid architectures").
Its KV per token counts the full-attention layers only; each linear layer keeps a state of
fixed size per request (conv and recurrent state) that NixlConnector moves beside it.
"""

import argparse
import json
import pathlib

# bfloat16 rounds differently where the decode instance computes the prompt's last token after
# a transfer than where one instance computes it all: with the usual 0.02 a random model's
# logits are so flat that greedy decoding flips on such near-ties; wider weights give peaked
# logits, so greedy identity tests the transferred state rather than the rounding.
INIT_RANGE_BF16 = 0.2
DEFAULTS = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 16384}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="model directory to write (created; must not hold a model)")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arch", choices=("llama", "qwen3_next"), default="llama",
                   help="dense GQA Llama (float32), or a Gated DeltaNet hybrid (bfloat16)")
    return p.parse_args(argv)


def write_tokenizer(out, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers  # reason: vllm venv only
    from transformers import PreTrainedTokenizerFast  # reason: vllm venv only
    vocab = {f"t{i}": i for i in range(vocab_size - 3)}
    for j, special in enumerate(("<unk>", "<s>", "</s>")):
        vocab[special] = vocab_size - 3 + j
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(out)


def llama(shape):
    """(config, model class, dtype, layers with a KV cache) of the dense GQA Llama."""
    import torch  # reason: vllm venv only (torch + transformers)
    from transformers import LlamaConfig, LlamaForCausalLM  # reason: as above
    cfg = LlamaConfig(**shape, bos_token_id=shape["vocab_size"] - 2,
                      eos_token_id=shape["vocab_size"] - 1, torch_dtype="float32",
                      tie_word_embeddings=False)
    return cfg, LlamaForCausalLM, torch.float32, shape["num_hidden_layers"]


def qwen3_next(shape):
    """The same for the Gated DeltaNet hybrid: every fourth layer full attention, dense MLPs
    but in the last layer (4 small experts, 2 per token: vLLM's Qwen3-Next needs one mixture
    of experts layer). Qwen3-Next rather than Qwen3.5: vLLM's Qwen3.5 module imports the vision
    model's code, which needs torchvision, and the CPU venv has none that matches its torch."""
    import torch  # reason: as above
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM  # reason: as above
    n, head_dim = shape["num_hidden_layers"], shape["hidden_size"] // shape["num_attention_heads"]
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    cfg = Qwen3NextConfig(
        **shape, head_dim=head_dim, layer_types=types, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        moe_intermediate_size=shape["intermediate_size"] // 4,
        shared_expert_intermediate_size=shape["intermediate_size"] // 4,
        mlp_only_layers=list(range(n - 1)),
        bos_token_id=shape["vocab_size"] - 2, eos_token_id=shape["vocab_size"] - 1,
        torch_dtype="bfloat16", tie_word_embeddings=False, initializer_range=INIT_RANGE_BF16)
    return cfg, Qwen3NextForCausalLM, torch.bfloat16, types.count("full_attention")


def write_model(args):
    import torch  # reason: vllm venv only (torch + transformers)
    out = pathlib.Path(args.dir)
    if (out / "config.json").exists():
        raise SystemExit(f"{out}: already holds a model (config.json); choose another dir")
    out.mkdir(parents=True, exist_ok=True)
    shape = {k: getattr(args, k) for k in DEFAULTS}
    cfg, cls, dtype, kv_layers = (qwen3_next if args.arch == "qwen3_next" else llama)(shape)
    torch.manual_seed(args.seed)
    model = cls(cfg).to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, shape["vocab_size"])
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv = kv_layers * shape["num_key_value_heads"] * head_dim * 2
    return {"dir": str(out.resolve()), "architecture": cls.__name__,
            "params": sum(p.numel() for p in model.parameters()), "head_dim": head_dim,
            "kv_layers": kv_layers,
            "kv_bytes_per_token": {"float32": kv * 4, "bfloat16": kv * 2}, **shape}


def main(argv=None):
    print(json.dumps(write_model(parse(argv))))


if __name__ == "__main__":
    main()
