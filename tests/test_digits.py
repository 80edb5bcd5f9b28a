"""The digit classifier behind prompt accuracy and classifier FD (flowfleet.evaluate.digits)."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch
from fixtures.tolerances import net_tol

from flowfleet.data.sources import DIGIT_WORDS
from flowfleet.evaluate.digits import FOLDER, DigitJudge, accuracy, mnist_tensors, prompted_digit
from flowfleet.evaluate.fid import FID, FIDSettings
from flowfleet.storage import RunRoot


@pytest.fixture(scope="module")
def judge(digit_classifier):
    return DigitJudge.load_or_train(digit_classifier, progress=False)


@pytest.fixture(scope="module")
def held_out():
    x, y = mnist_tensors()
    return x[4000:], y[4000:]  # the classifier trains on the first 4000 only


def _prompts(digits):
    return [f"a handwritten digit {DIGIT_WORDS[int(d)]}" for d in digits]


def test_prompted_digit_reads_words_and_numerals():
    assert prompted_digit("a handwritten digit seven") == 7
    assert prompted_digit("A Handwritten Digit ZERO") == 0
    assert prompted_digit("the number 3, drawn thin") == 3
    assert prompted_digit("a red star on a blue background") is None
    assert prompted_digit("someone") is None  # "one" only as a whole word


def test_classifier_reads_held_out_digits(judge, held_out):
    x, y = held_out
    assert judge.val_accuracy >= 0.97
    # The recorded accuracy came from the same network on the same images, maybe in another process: a
    # prediction can flip only where the two best logits are within rounding of each other (the longest
    # reduction is the 3136-input linear layer; 6 layers), so that many hits may differ, and no more.
    with torch.no_grad():
        top2 = judge.net.eval()(x).topk(2, dim=1).values  # [N, 2]
    ties = int((top2[:, 0] - top2[:, 1] <= 2 * net_tol(top2, 64 * 7 * 7, 6)).sum())
    assert abs(accuracy(judge.net, x, y) - judge.val_accuracy) <= ties / len(y)
    result = judge.prompt_accuracy(x, _prompts(y))
    assert result["accuracy"] >= 0.95
    assert result["n"] == 1000 and result["skipped"] == 0
    assert min(result["per_class"].values()) >= 0.85
    wrong = judge.prompt_accuracy(x, _prompts((y + 1) % 10))  # every prompt names another digit
    assert wrong["accuracy"] <= 0.05


def test_classifier_gives_chance_or_less_on_noise(judge):
    gen = torch.Generator().manual_seed(0)
    digits = torch.arange(500) % 10
    for noise in (
        torch.rand(500, 1, 28, 28, generator=gen) * 2 - 1,
        torch.randn(500, 1, 32, 32, generator=gen).clamp(-1, 1),
        torch.full((500, 1, 28, 28), -1.0),
    ):
        assert judge.prompt_accuracy(noise, _prompts(digits))["accuracy"] <= 0.2


def test_prompts_without_digits_are_counted_and_skipped(judge, held_out):
    x, y = held_out
    prompts = _prompts(y[:10])
    prompts[3] = "a cat"
    result = judge.prompt_accuracy(x[:10], prompts)
    assert result["n"] == 9 and result["skipped"] == 1


def test_cached_classifier_is_loaded_not_retrained(digit_classifier, tmp_path, monkeypatch):
    import flowfleet.evaluate.digits as digits

    copy = RunRoot(str(tmp_path))
    for name in ("model.safetensors", "classifier.json"):
        copy.write_bytes(digit_classifier.read_bytes(*FOLDER, name), *FOLDER, name)
    monkeypatch.setattr(digits, "train_classifier", lambda *a, **k: pytest.fail("retrained a cached classifier"))
    loaded = DigitJudge.load_or_train(copy, progress=False)
    original = DigitJudge.load_or_train(digit_classifier, progress=False)
    for a, b in zip(loaded.net.state_dict().values(), original.net.state_dict().values()):
        assert torch.equal(a, b)


def test_classifier_fd_separates_digits_from_noise(judge, held_out):
    x, _ = held_out
    fd = FID(FIDSettings(batch_size=250), extractor=judge.extractor())
    assert fd.key == "digits-128"
    real_a = fd.statistics([x[:500]])
    real_b = fd.statistics([x[500:]])
    noise = fd.statistics([torch.rand(500, 1, 28, 28, generator=torch.Generator().manual_seed(1)) * 2 - 1])
    same, far = fd.score(real_a, real_b), fd.score(noise, real_b)
    assert same < 0.1 * far


def test_a_cached_classifier_of_another_network_is_retrained(digit_classifier, tmp_path, monkeypatch):
    import flowfleet.evaluate.digits as digits

    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "machine"))  # a machine that holds no judge yet
    copy = RunRoot(str(tmp_path / "run"))
    copy.write_bytes(digit_classifier.read_bytes(*FOLDER, "model.safetensors"), *FOLDER, "model.safetensors")
    record = {**digit_classifier.read_json(*FOLDER, "classifier.json"), "network": "digitnet-1"}
    copy.write_json(record, *FOLDER, "classifier.json")
    trained = []

    def fake_train(x, y, settings, progress=True):
        trained.append(len(y))
        return digits.DigitNet(), {"network": digits.NETWORK, "settings": asdict(settings), "val_accuracy": 0.0}

    monkeypatch.setattr(digits, "train_classifier", fake_train)
    judge = DigitJudge.load_or_train(copy, progress=False)
    assert trained == [5000] and judge.record["network"] == digits.NETWORK
    assert copy.read_json(*FOLDER, "classifier.json")["network"] == digits.NETWORK  # the run now holds the new one
    machine = RunRoot(str(tmp_path / "machine" / digits.MACHINE_FOLDER))
    (digest,) = machine.ls()
    assert machine.read_json(digest, "classifier.json")["network"] == digits.NETWORK  # and so does the machine
    # the right network trained with another recipe is not this judge either: the run's is replaced by the machine's
    record = {**digit_classifier.read_json(*FOLDER, "classifier.json"), "settings": {"epochs": 8}}
    copy.write_json(record, *FOLDER, "classifier.json")
    DigitJudge.load_or_train(copy, progress=False)
    assert trained == [5000] and copy.read_json(*FOLDER, "classifier.json")["settings"] != {"epochs": 8}
    # ... and trained again where the machine's is of another recipe too
    copy.write_json(record, *FOLDER, "classifier.json")
    machine.write_json(
        {**machine.read_json(digest, "classifier.json"), "settings": {"epochs": 8}}, digest, "classifier.json"
    )
    DigitJudge.load_or_train(copy, progress=False)
    assert trained == [5000, 5000]


def test_a_run_without_a_judge_takes_the_machines_without_training(digit_classifier, tmp_path, monkeypatch):
    import flowfleet.evaluate.digits as digits
    from flowfleet.data.sources.mnist.digits import load_mnist_5k

    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "machine"))
    machine = RunRoot(str(tmp_path / "machine" / digits.MACHINE_FOLDER / load_mnist_5k().digest))
    for name in ("model.safetensors", "classifier.json"):  # the judge this machine trained once
        machine.write_bytes(digit_classifier.read_bytes(*FOLDER, name), name)
    monkeypatch.setattr(digits, "train_classifier", lambda *a, **k: pytest.fail("trained the machine's judge again"))
    run = RunRoot(str(tmp_path / "run"))
    judge = DigitJudge.load_or_train(run, progress=False)
    for a, b in zip(
        judge.net.state_dict().values(), DigitJudge.load_or_train(digit_classifier).net.state_dict().values()
    ):
        assert torch.equal(a, b)
    # the run carries its copy of the judge of its figures, byte for byte
    assert run.read_bytes(*FOLDER, "model.safetensors") == machine.read_bytes("model.safetensors")
    assert run.read_json(*FOLDER, "classifier.json")["sha256"] == machine.read_json("classifier.json")["sha256"]


def test_a_judge_trains_to_the_same_weights_whatever_the_callers_thread_count():
    import torch.nn.functional as F

    from flowfleet.evaluate.digits import DigitNet, TrainSettings
    from flowfleet.evaluate.judge import fit_classifier

    x = torch.randn(256, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (256,), generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    weights = []
    try:
        for threads in (1, 3):  # a one-core box and a bigger one than the judges' two threads
            torch.set_num_threads(threads)
            torch.manual_seed(0)
            net = DigitNet()

            def loss(i: torch.Tensor, net: DigitNet = net) -> torch.Tensor:
                return F.cross_entropy(net(x[i]), y[i])

            fit_classifier(net, 256, loss, TrainSettings(epochs=1), torch.Generator().manual_seed(0), "t", False)
            assert torch.get_num_threads() == threads  # the caller's count, restored
            weights.append(net.state_dict())
    finally:
        torch.set_num_threads(before)
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])  # bit for bit: sums in the same order
