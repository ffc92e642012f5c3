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
"""

import argparse
import json
import pathlib

DEFAULTS = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 16384}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", help="model directory to write (created; must not hold a model)")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--seed", type=int, default=0)
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


def write_model(args):
    import torch  # reason: vllm venv only (torch + transformers)
    from transformers import LlamaConfig, LlamaForCausalLM  # reason: as above
    out = pathlib.Path(args.dir)
    if (out / "config.json").exists():
        raise SystemExit(f"{out}: already holds a model (config.json); choose another dir")
    out.mkdir(parents=True, exist_ok=True)
    shape = {k: getattr(args, k) for k in DEFAULTS}
    cfg = LlamaConfig(**shape, bos_token_id=shape["vocab_size"] - 2,
                      eos_token_id=shape["vocab_size"] - 1, torch_dtype="float32",
                      tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(out, shape["vocab_size"])
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv = shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * 2
    return {"dir": str(out.resolve()), "architecture": "LlamaForCausalLM",
            "params": sum(p.numel() for p in model.parameters()), "head_dim": head_dim,
            "kv_bytes_per_token": {"float32": kv * 4, "bfloat16": kv * 2}, **shape}


def main(argv=None):
    print(json.dumps(write_model(parse(argv))))


if __name__ == "__main__":
    main()
