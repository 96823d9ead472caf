"""The mutation list (``tests/test_mutations.py``) against the whole settings-space harness: each plausible
bug applied alone, then every check of the harness run on it (the accepted combinations, each registered
entry's check against its documented objective, the update's step, the staleness admission, the figures over
seeds); reports which checks catch each bug, and how long the harness took with it. ``make test`` runs each
bug against its own entry's check only.

    .venv/bin/python benchmarks/mutations.py [--only SUBSTRING ...]
"""

from __future__ import annotations

import argparse
import time
import warnings

import pytest
from _bench import RESULTS, stamp, write_results

from learner.advantages import ESTIMATORS
from learner.kl import KL_ESTIMATORS
from learner.policy_losses import POLICY_LOSSES
from tests import test_settings_space as harness
from tests.test_mutations import MUTANTS


def checks(entry: str = "", settings: dict | None = None) -> dict:
    """The harness's checks by name, each a function of the collected problems; ``entry``'s own check also
    with the ``settings`` its mutant is checked at (PPO's clip-higher, say)."""

    def own(name: str) -> dict:
        return settings if name == entry and settings else {}

    return {
        "combinations": harness.test_every_accepted_combination_is_exact_bounded_or_biased_by_design_and_every_refusal_names_its_fields,  # noqa: E501
        "policy losses": lambda p: [harness.check_policy_loss_entry(n, **own(n))
                                    for n in POLICY_LOSSES.names()],
        "corrections": lambda p: [harness.check_correction_entry(n, level, mode, **own(n)) for n, level in
                                  harness.CORRECTION_LEVELS for mode in ("async", "async_mixed")],
        "kl estimators": lambda p: [harness.check_kl_estimator_entry(n, p) for n in KL_ESTIMATORS.names()],
        "advantage estimators": lambda p: [harness.check_advantage_estimator_entry(n)
                                           for n in ESTIMATORS.names()],
        "update": harness.check_update,
        "admission": harness.check_admission,
        "correction figures": lambda p: harness.test_rollout_correction_and_placement_figures_over_seeds(),
        "policy loss figures": lambda p: harness.test_policy_loss_figures_off_the_first_step(),
    }


def run(mutant: str | None = None) -> dict:
    """Every check on the tree with ``mutant`` applied (None: the tree itself): the ones that caught it (an
    assertion) and the ones that broke on it otherwise (an exception)."""
    _, entry, patch, settings = MUTANTS[mutant] if mutant else (None, "", lambda mp: None, {})
    caught, broke = [], []
    t0 = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patch(mp)
        problems = harness.make_problems()  # collected under the patch, as a rank would
        for name, check in checks(entry, settings).items():
            try:
                check(problems)
            except AssertionError:
                caught.append(name)
            except Exception as err:  # noqa: BLE001 - reported, not a catch
                broke.append(f"{name} ({type(err).__name__})")
    return {"caught": caught, "broke": broke, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", default=[], help="run the mutants whose name holds one of these")
    args = parser.parse_args()
    names = [m for m in MUTANTS if not args.only or any(o in m for o in args.only)]
    t0 = time.perf_counter()
    clean = run()
    if clean["caught"] or clean["broke"]:  # then no catch would mean anything
        raise SystemExit(f"the harness fails on the tree itself: {clean}")
    rows = {}
    for name in names:
        rows[name] = run(name)
        print(f"{name}: caught by {', '.join(rows[name]['caught']) or 'NOTHING'} ({rows[name]['seconds']} s)",
              flush=True)
    total = len(checks())
    caught = sum(bool(r["caught"]) for r in rows.values())
    head = (f"{len(names)} mutants against the whole harness ({total} checks, every one passing on the tree "
            f"itself); {caught} caught, in {time.perf_counter() - t0:.0f} s.")
    table = [head, "",
             "| mutant | caught by | checks that catch it | seconds |", "|---|---|---|---|"]
    table += [f"| {name} | {', '.join(r['caught']) or '**nothing**'} | {len(r['caught'])} of {total} | "
              f"{r['seconds']} |" for name, r in rows.items()]
    json_path, md_path = write_results(RESULTS, "mutations", {**stamp(), "mutants": rows}, table)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
