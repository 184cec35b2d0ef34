"""gactx/integrations.py: the Hugging Face TrainerCallback on a tiny BERT from a config and generated data."""

import pytest
import torch

pytest.importorskip("accelerate")  # the Trainer needs it
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments  # noqa: E402

from gactx.integrations import GactxCallback  # noqa: E402


class Generated(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, length: int = 32) -> None:
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(5, 100, (n, length), generator=gen)
        self.labels = (self.ids[:, 0] > 50).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _trainer(tmp_path, callback):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, num_labels=2)  # fmt: skip
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=16,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=Generated(), callbacks=[callback])


@pytest.mark.parametrize("level", ["L1", "L2.2"])
def test_trainer_callback_compresses_and_removes_its_hooks(tmp_path, level):
    data = Generated()
    probe = {"input_ids": data.ids[:4], "labels": data.labels[:4]} if level == "L2.2" else None
    callback = GactxCallback(level=level, probe_batch=probe)
    result = _trainer(tmp_path, callback).train()
    controller = callback.controller
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert controller.step == 4 and not controller.installed
    stats = controller.memory_stats()
    assert stats.compressed > 10 and stats.ratio > 3
    if level == "L2.2":
        assert controller.last_adaptation is not None and controller.last_adaptation.step == 1


def test_adaptive_level_without_a_probe_batch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="give GactxCallback a probe_batch"):
        _trainer(tmp_path, GactxCallback(level="L2.2")).train()
