"""The library, the command line and the server agree on every default they share: a user calling
`flowfleet.stages.generate.generate` gets what `flowfleet generate` gives, and `flowfleet serve` what `serve()` does
(the image split over processes was `sync` in the library and `displaced` on the command line until this test).
Sampling settings are declared once (config.SamplingSettings): every way in resolves a call's the same way."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest
from fixtures.random_fleet import FOLDER_SETTINGS, HashTextEncoder, tiny_run_config, write_random_fleet
from pydantic import ValidationError

from flowfleet.cli import build_parser
from flowfleet.commands.evaluate import EVALUATION_OWN
from flowfleet.commands.options import sampling_choices
from flowfleet.config import SAMPLING_CHOICES
from flowfleet.sampling.card import read_card
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.serve.app import serve
from flowfleet.serve.openai_api import ImagesRequest
from flowfleet.serve.service import FleetService, GenerateRequest, ServeLimits
from flowfleet.stages.assemble import assemble
from flowfleet.stages.evaluate import EvaluateOptions
from flowfleet.stages.generate import generate

# a call's choices, each unlike the folder's and the defaults
CHOICES = dict(
    steps=3,
    sampler="euler",
    guidance_scale=2.0,
    guidance_max_t=0.5,
    shift=1.5,
    strategy="full",
    guidance="mixture",
    route_every=1,
    seed=4,
    cache=0.1,
)


def command(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def cli_defaults(name: str) -> dict[str, object]:
    return {a.dest: a.default for a in command(name)._actions if a.dest != "help"}


def shared(library: dict[str, object], cli: dict[str, object]) -> list[str]:
    return sorted(set(library) & set(cli))


@pytest.mark.parametrize(
    "name, function",
    [("generate", generate), ("serve", serve)],
)
def test_the_library_and_the_command_line_share_every_default(name, function):
    library = {
        p.name: p.default
        for p in inspect.signature(function).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    cli = cli_defaults(name)
    common = shared(library, cli)
    assert {"parallel", "warmup", "nproc", "ulysses_degree", "device"} <= set(common)
    assert {k: library[k] for k in common} == {k: cli[k] for k in common}


def test_evaluate_options_and_the_command_line_share_every_default():
    library = {f.name: f.default for f in dataclasses.fields(EvaluateOptions) if f.default is not dataclasses.MISSING}
    cli = cli_defaults("evaluate")
    for k, v in cli.items():  # a list option's default is its comma-separated text (--strategies top1,top2,full)
        # (numbers as the library's: --guidance-bounds 1,16)
        if isinstance(library.get(k), tuple) and isinstance(v, str):
            kind = type(library[k][0]) if library[k] else str
            cli[k] = tuple(kind(x) for x in v.split(",") if x)
    common = shared(library, cli)
    assert {"n", "seed", "strategies", "repeats", "min_accuracy", "guidance_bounds", "guidance_extend"} <= set(common)
    assert {k: library[k] for k in common} == {k: cli[k] for k in common}
    unset = build_parser().parse_args(["evaluate", "DIR"])  # no sampling option given: every model's own
    assert sampling_choices(unset, without=EVALUATION_OWN) == EvaluateOptions().sampling == {}


@pytest.fixture(scope="module")
def pipe(tmp_path_factory) -> FleetPipeline:
    run = tmp_path_factory.mktemp("defaults") / "run"
    write_random_fleet(str(run), tiny_run_config(3, **FOLDER_SETTINGS))
    return FleetPipeline.from_pretrained(assemble(str(run)).out, text_encoder=HashTextEncoder(384, 4))


def cli_args(command: str, choices: dict[str, object]) -> list[str]:
    return [command, "DIR"] + [x for n, v in choices.items() for x in (f"--{n.replace('_', '-')}", str(v))]


@pytest.mark.parametrize("choices", [{}, CHOICES], ids=["nothing chosen", "every setting chosen"])
def test_every_way_in_samples_with_the_same_settings(pipe, choices):
    """The library's call, `flowfleet generate`, `flowfleet evaluate`, /api/generate and /v1/images/generations:
    the folder's settings where nothing is chosen, the call's where it is."""
    want = pipe.settings(**choices)
    expected = {**FOLDER_SETTINGS, "seed": 0, "cache": 0.0, "k": 1} if not choices else {**CHOICES, "k": 3}
    assert want.to_json() == expected

    generate_args = build_parser().parse_args(cli_args("generate", choices))
    assert pipe.settings(**sampling_choices(generate_args)) == want

    own = {n: v for n, v in choices.items() if n not in EVALUATION_OWN}
    evaluate_args = build_parser().parse_args(cli_args("evaluate", own))
    options = EvaluateOptions(sampling=sampling_choices(evaluate_args, without=EVALUATION_OWN))
    options.validate()
    assert pipe.settings(want.strategy, seed=want.seed, **options.sampling) == want

    service = FleetService(pipe, read_card(pipe.folder), ServeLimits())
    assert service.check(GenerateRequest(prompt="a digit", **choices)) == want
    openai = ImagesRequest.model_validate({"prompt": "a digit", **choices})
    assert service.check(openai.generate_request()) == want


def test_every_sampling_setting_is_an_option_and_a_request_field():
    """A setting declared in config.SamplingSettings is an option of `generate` and `evaluate` (but those evaluate
    sets itself) and a field of a server request, with nothing else to add."""
    generate_options = {a.dest for a in command("generate")._actions}
    evaluate_options = {a.dest for a in command("evaluate")._actions}
    assert set(SAMPLING_CHOICES) <= generate_options
    assert set(SAMPLING_CHOICES) - set(EVALUATION_OWN) <= evaluate_options
    assert GenerateRequest(prompt="x", **CHOICES).choices() == CHOICES
    with pytest.raises(ValueError, match="stepz: not a field of a request nor a sampling setting"):
        GenerateRequest(prompt="x", stepz=3)
    with pytest.raises(ValidationError) as info:  # any JSON key: the message stays one short line
        GenerateRequest.model_validate({"prompt": "x", "\n" + "x" * 100: 3})
    message = info.value.errors()[0]["msg"]
    assert message.startswith("Value error, '\\nxxx") and "\n" not in message and len(message) < 200
