"""python recipes/generate.py --model outputs/run/model --prompt "ROMEO:" --num_samples 3 --max_new_tokens 200

Sample text from a trained model: the quickest look at what it has learnt.

    python recipes/generate.py --model outputs/run/model --prompt "ROMEO:" --temperature 0     # greedy
    python recipes/generate.py --model outputs/run/model --prompt "ROMEO:" --output_file samples.json

A falling loss says the model got better; a few samples say at what. The script loads any exported
Hugging Face causal-LM folder (the model and the tokenizer saved next to it, e.g. `<output_dir>/model`
from recipes/train.py; local files only, nothing is downloaded) and prints --num_samples continuations
of --prompt, each as prompt + continuation, through transformers' `model.generate`. The same --seed
on the same device gives the same text. Plain Python, no `accelerate launch`: one process, one device.

Bad input (a folder that is not a model, a prompt the tokenizer cannot encode, a count out of range)
is one `error: ...` line on stderr and exit code 2.
"""

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from common import config
from common.config import ConfigError
from common.model import custom_code_refused, ships_code


@dataclass
class GenerateConfig:
    model: str = field(metadata={"help": "Exported Hugging Face folder: config.json, weights and the tokenizer."})
    prompt: str = field(metadata={"help": "Text to continue; encoded without BOS, as the training data was."})
    num_samples: int = field(default=3, metadata={"help": "Continuations to write (one batch)."})
    max_new_tokens: int = field(default=200, metadata={"help": "Most tokens to generate per sample."})
    temperature: float = field(
        default=1.0, metadata={"help": "Softmax temperature; 1 = the model's own distribution, 0 = greedy."}
    )
    top_k: int = field(default=0, metadata={"help": "Sample among the k likeliest tokens only; 0 = all tokens."})
    seed: int = field(default=1234, metadata={"help": "Seed for sampling: the same seed gives the same text."})
    stop_at_eos: bool = field(
        default=True,
        metadata={"help": "End a sample at the tokenizer's EOS; false = always exactly --max_new_tokens tokens."},
    )
    device: str | None = field(default=None, metadata={"help": "Default: cuda if available, else cpu."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the Python code the folder ships (auto_map in its config); off: refused."}
    )
    output_file: str | None = field(
        default=None, metadata={"help": "Also write the samples and these settings as JSON."}
    )

    def __post_init__(self):
        # Checks that need no model: they run before anything is loaded.
        for name in ("num_samples", "max_new_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be positive, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"--top_k must be >= 0 (0 = no cut), got {self.top_k}")
        if not self.prompt:
            raise ConfigError("--prompt is empty; give some text to continue")
        if not os.path.isdir(self.model):
            raise ConfigError(f"model folder not found: {self.model}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ConfigError(f"not a model folder (no config.json): {self.model}")


class _OneLineErrorParser(HfArgumentParser):
    """argparse would print usage and exit; raise instead, so run_cli prints one `error:` line."""

    def error(self, message):
        raise ConfigError(message)


def parse_args(argv: list[str] | None) -> GenerateConfig:
    parser = _OneLineErrorParser(GenerateConfig)
    args, remaining = parser.parse_args_into_dataclasses(
        args=argv, return_remaining_strings=True, look_for_args_file=False
    )
    if remaining:  # a typo must not silently sample with a default
        raise ConfigError(f"unknown option(s): {' '.join(remaining)} (see --help)")
    return args


def resolve_device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown --device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    return device


def check_causal_lm(folder: str, trust_remote_code: bool = False) -> None:
    """Read config.json alone (no weights): a broken file or a model that cannot write fails here."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise custom_code_refused(err, folder) or ConfigError(
            f"cannot read the model config in {folder}: {config.one_line(err)}") from None
    custom = ships_code(model_config) and "AutoModelForCausalLM" in getattr(model_config, "auto_map", {})
    if type(model_config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not custom:
        raise ConfigError(f"{folder} holds a {type(model_config).__name__} model, which is not a causal LM")


def load_tokenizer(folder: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as err:
        raise custom_code_refused(err, folder) or ConfigError(
            f"cannot load a tokenizer from {folder}: {config.one_line(err)}") from None


def encode_prompt(tokenizer, prompt: str) -> list[int]:
    # No BOS: the training data is tokenised the same way (documents without BOS, then EOS).
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    if not ids:
        raise ConfigError(f"the tokenizer encodes --prompt {prompt!r} to no tokens")
    if tokenizer.unk_token_id is not None and tokenizer.unk_token_id in ids:
        raise ConfigError(f"the tokenizer cannot encode part of --prompt {prompt!r} (it becomes the unknown token)")
    return ids


def load_model(folder: str, device, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise custom_code_refused(err, folder) or ConfigError(
            f"cannot load a causal LM from {folder}: {config.one_line(err)}") from None
    return model.to(device).eval()


def new_token_counts(new_tokens, eos_id: int | None) -> list[int]:
    """Tokens each sample really produced: up to and including its EOS; after it is only padding."""
    counts = []
    for row in new_tokens.tolist():
        counts.append(row.index(eos_id) + 1 if eos_id is not None and eos_id in row else len(row))
    return counts


def main(argv=None):
    args = parse_args(argv)
    device = resolve_device(args.device)
    check_causal_lm(args.model, args.trust_remote_code)
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)  # before the weights: a bad prompt fails fast
    prompt_ids = encode_prompt(tokenizer, args.prompt)
    model = load_model(args.model, device, args.trust_remote_code)

    import torch
    from transformers import set_seed

    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and len(prompt_ids) + args.max_new_tokens > positions:
        print(f"warning: prompt + --max_new_tokens = {len(prompt_ids) + args.max_new_tokens} tokens, beyond the "
              f"{positions} positions of the model; the tail may be garbage", file=sys.stderr)

    # EOS and padding come from the tokenizer, which wrote the training data: an exported config
    # can keep its architecture's defaults (a random-init Llama says eos=2, the byte tokenizer's <unk>).
    eos_id = tokenizer.eos_token_id if args.stop_at_eos else None
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    greedy = args.temperature == 0
    sampling = {} if greedy else {"temperature": args.temperature, "top_k": args.top_k, "top_p": 1.0}

    input_ids = torch.tensor([prompt_ids], device=device)
    set_seed(args.seed)
    sequences = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=not greedy,
        **sampling,  # top_p pinned to 1: no filter beyond the options above, whatever the folder's defaults say
        # greedy decoding gives one answer; generate refuses to repeat it, so it is copied below
        num_return_sequences=1 if greedy else args.num_samples,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=eos_id,  # None: never stop early, so exactly --max_new_tokens tokens
        pad_token_id=pad_id,  # fills the rows that stopped early; passing it also silences a warning
        use_cache=True,  # training exports say use_cache=False; without the KV cache generation is quadratic
    )
    if greedy:
        sequences = sequences.expand(args.num_samples, -1)

    counts = new_token_counts(sequences[:, len(prompt_ids):], eos_id)
    samples = [tokenizer.decode(row[: len(prompt_ids) + n], skip_special_tokens=True)
               for row, n in zip(sequences.tolist(), counts)]
    for i, text in enumerate(samples, start=1):
        print(f"---------- sample {i} ----------")
        print(text)

    if args.output_file:
        settings = {**dataclasses.asdict(args), "device": str(device)}
        if os.path.dirname(args.output_file):
            os.makedirs(os.path.dirname(args.output_file), exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump({"settings": settings, "samples": samples, "new_tokens": counts}, f, indent=2)


if __name__ == "__main__":
    sys.exit(config.run_cli(main))
