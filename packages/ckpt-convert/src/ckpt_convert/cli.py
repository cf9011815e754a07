"""`ckpt-convert hf2mcore|mcore2hf`: the command line over ckpt_convert.convert (the only place that prints)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

logger = logging.getLogger(__name__)


def _size(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (a scheduler stopping the job) unwinds like Ctrl-C: temp output removed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckpt-convert", description="Hugging Face <-> megatron-core checkpoints")
    sub = parser.add_subparsers(dest="command", required=True)
    h2m = sub.add_parser("hf2mcore", help="HF safetensors -> megatron-core torch_dist checkpoint")
    h2m.add_argument("--hf", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    h2m.add_argument("--out", required=True, help="output directory (must not exist)")
    h2m.add_argument("--tp", type=_size, default=1, help="tensor parallel size (vocab padding, divisibility checks)")
    h2m.add_argument("--pp", type=_size, default=1, help="pipeline parallel size (divisibility check)")
    h2m.add_argument("--ep", type=_size, default=1, help="expert parallel size (MoE; divisibility check)")
    h2m.add_argument("--dtype", choices=["fp32", "bf16"], default=None,
                     help="stored dtype (default: the HF checkpoint's; bf16 stays bf16, anything else is fp32)")
    m2h = sub.add_parser("mcore2hf", help="megatron-core checkpoint (+ ckpt_convert.json; e.g. a Megatron engine checkpoint) -> HF safetensors")
    m2h.add_argument("--mcore", required=True, help="megatron checkpoint directory")
    m2h.add_argument("--out", required=True, help="output directory (must not exist)")
    m2h.add_argument("--base-model", metavar="DIR", default=None,
                     help="a LoRA checkpoint (the adapters alone): the HF directory of its base model (default: the "
                          "one it was trained on, recorded in ckpt_convert.json; it must hold the same weights)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ckpt_convert").setLevel(logging.INFO)  # the conversion summary
    from ckpt_convert.convert import convert_hf_to_mcore, convert_mcore_to_hf

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.command == "hf2mcore":
            out = convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype)
        else:
            out = convert_mcore_to_hf(args.mcore, args.out, base_model=args.base_model)
    except (ValueError, OSError) as err:  # OSError: a path that cannot be read or written, named in err
        print(f"ckpt-convert {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ckpt-convert {args.command}: interrupted; no output written", file=sys.stderr)
        return 130
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
