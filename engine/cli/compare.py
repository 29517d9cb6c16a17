"""``meganeura compare A.json B.json``: two ``profile --json`` outputs, kernel by kernel
(``engine.runtime.compare``)."""

from __future__ import annotations

from .commands import _print_json
from .registry import at_least_one, register_command


def _compare_arguments(parser) -> None:
    parser.add_argument("a", metavar="A.json", help="the baseline: a file written by meganeura profile --json")
    parser.add_argument("b", metavar="B.json", help="the profile compared with it")
    parser.add_argument("--top", type=at_least_one, default=30, help="matched kernels shown in the table (default 30)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _compare(args) -> int:
    from ..runtime.compare import compare_profiles, format_comparison, load_profile

    a, b = load_profile(args.a), load_profile(args.b)
    comparison = compare_profiles(a, b, args.a, args.b)
    if args.json:
        _print_json(comparison)
    else:
        print(format_comparison(comparison, top=args.top))
    return 0


register_command("compare", "two profile --json outputs side by side, kernel by kernel",
                 _compare_arguments, _compare)
