"""``meganeura generate SOURCE``: text from a causal language model with a KV cache,
streamed to stdout as it comes; ``--json`` prints the ids, the text and the timings."""

from __future__ import annotations

import sys

from ..errors import MeganeuraError
from .commands import _model_arguments, _print_json, adapter_summary, backend_argument, load_model, resolve_backend
from .registry import register_command


def _generate_arguments(parser) -> None:
    _model_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="the prompt, tokenized with the checkpoint's tokenizer.json "
                                                         "(a folder without one takes --prompt-ids)")
    prompt.add_argument("--prompt-ids", metavar="1,2,3", help="the prompt as token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 (default): greedy; above 0: sample from softmax(logits / T), seeded by --seed")
    parser.add_argument("--top-k", type=int, default=0, metavar="K", help="sample among the K most likely (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="sample among the most likely tokens whose probabilities reach P (default 1: all)")
    backend_argument(parser)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise MeganeuraError(f"--prompt-ids {text!r}: give integers separated by commas, e.g. 1,2,3") from None


def _tokenizer(model, ids_given: bool):
    """The model's tokenizer; None where it has none and the prompt came as ids (the new ids
    are then printed as ids, and ``--json``'s text is null)."""
    try:
        return model.tokenizer()
    except MeganeuraError:
        if ids_given:
            return None
        raise


def _generate(args) -> int:
    from ..data.tokenizer import TextStream
    from ..train.generation import Sampling
    model, params = load_model(args)
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    generator = model.generator(params, backend=resolve_backend(args))
    tokenizer = _tokenizer(model, ids_given=args.prompt is None)
    if tokenizer is not None and tokenizer.note and args.prompt is not None:
        print(f"meganeura: note: {tokenizer.note}", file=sys.stderr, flush=True)
    prompt = tokenizer.encode(args.prompt) if args.prompt is not None else parse_ids(args.prompt_ids)
    stream = TextStream(tokenizer) if tokenizer is not None else None

    def show(token, _ms):
        piece = stream.push(token) if stream is not None else f"{token} "
        if not args.json and piece:
            print(piece, end="", flush=True)

    result = generator.generate(prompt, args.max_new_tokens, sampling, model.eos_ids(), on_token=show)
    text = tokenizer.decode(result.tokens) if tokenizer is not None else None
    if args.json:
        _print_json({"model": model.name, "backend": generator.backend, "prompt_tokens": len(prompt),
                     "tokens": result.tokens, "text": text, "stopped": result.stopped,
                     "build_seconds": result.build_seconds, "prefill_seconds": result.prefill_seconds,
                     "decode_tokens_per_second": result.decode_tokens_per_second,
                     "per_token_ms": result.per_token_ms, "capacity": result.capacity,
                     "weights_in_bf16": len(generator.bf16_weights()),
                     "adapter": adapter_summary(generator.backend)})
        return 0
    print(stream.flush() if stream is not None else "", flush=True)
    rate = result.decode_tokens_per_second
    kept = len(generator.bf16_weights())
    print(f"{len(result.tokens)} tokens ({result.stopped}); built in {result.build_seconds:.2f} s; "
          f"prefill of {len(prompt)} tokens "
          f"{1000 * result.prefill_seconds:.1f} ms" + (f", decode {rate:.1f} tokens/s" if rate else "")
          + (f"; {kept} weights kept in bf16, as the checkpoint stores them" if kept else ""), file=sys.stderr)
    return 0


register_command("generate", "generate text from a causal language model (KV cache, greedy or sampled)",
                 _generate_arguments, _generate)
