"""gactx/controller/policy.py: the model's storages are read once a pass from tables found by a walk of its modules,
walked again when a module is added to the model, not when a forward builds a container of its modules."""

import torch
from torch import nn

import gactx
from gactx.controller import policy
from gactx.controller.policy import ModelStorages, storage_ptr


class Sliced(nn.Module):
    """A forward that builds a new ModuleList of its layers every call, as transformers' decoders do
    (``self.layers[: self.config.num_hidden_layers]``)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers[:2]:
            x = torch.tanh(layer(x))
        return x


def _counting_walks(monkeypatch) -> list[int]:
    walks, walk = [], policy._tables

    def counted(model):
        walks.append(1)
        return walk(model)

    monkeypatch.setattr(policy, "_tables", counted)
    return walks


def test_a_container_built_in_forward_does_not_walk_the_model_again(monkeypatch):
    walks, model = _counting_walks(monkeypatch), Sliced()
    storages = ModelStorages(model)
    ptrs = storages()
    assert ptrs == {storage_ptr(p) for p in model.parameters()} and len(walks) == 1
    model(torch.randn(2, 8))  # two layers added to a new ModuleList: no module of the model
    assert storages() == ptrs and len(walks) == 1


def test_a_module_added_to_the_model_is_found_at_the_next_read(monkeypatch):
    walks, model = _counting_walks(monkeypatch), Sliced()
    storages = ModelStorages(model)
    storages()
    model.layers[0].extra = nn.Linear(8, 8)  # a module of the model gets a child
    ptrs = storages()
    assert len(walks) == 2 and storage_ptr(model.layers[0].extra.weight) in ptrs
    model.layers[0].extra.weight = nn.Parameter(torch.randn(8, 8))  # a swapped parameter: read again, no walk
    assert storage_ptr(model.layers[0].extra.weight) in storages() and len(walks) == 2


def test_a_sliced_models_training_walks_it_once(monkeypatch):
    walks, model = _counting_walks(monkeypatch), Sliced()
    x = torch.randn(4, 8)
    with gactx.Controller(model, level="L1") as controller:
        for _ in range(4):
            model(x).sum().backward()
            controller.iterate()
    assert len(walks) == 1 and controller.records
