"""Fixtures of the speculation stage tests: API clients, a tiny model directory, ACE served by uvicorn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ace import processes
from tests.support.stack import start_ace


@pytest.fixture(autouse=True)
def _no_suffix_store_carried_over() -> None:
    """Suffix decoding's per-process store is keyed by endpoint id, and a rolled-back test's ids come again."""
    from speculation.worker import suffix_store

    suffix_store.forget()


@pytest.fixture
def user(django_user_model):
    # An admin: the stage tests are about speculation, not ownership (roles: tests/fleet/test_roles.py).
    from fleet.permissions import ADMIN, grant_role

    user = django_user_model.objects.create_user(username="stage-admin", password="pw-for-tests-only")
    grant_role(user=user, role=ADMIN)
    return user


@pytest.fixture
def token(user) -> str:
    from rest_framework.authtoken.models import Token

    return Token.objects.create(user=user).key


@pytest.fixture
def api(token):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with its own small BPE tokenizer: a draft directory for registry tests."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(
        out
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def ace_server(django_db_setup, redis_server, artifacts_dir: Path) -> Iterator[processes.ManagedProcess]:
    proc = start_ace(redis_url=redis_server.url, log_dir=artifacts_dir)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def gateway_client(ace_server, token):
    """The official openai client pointed at ACE."""
    import openai

    return openai.OpenAI(base_url=ace_server.url + "/v1", api_key=token, max_retries=0, timeout=120)


@pytest.fixture
def other_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with perturbed weights (same tokenizer): a target that differs from the draft."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    out = tmp_path / "tiny-target"
    shutil.copytree(tiny_model_dir, out)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.std())
    model.save_pretrained(out)
    return out


@pytest.fixture
def fresh_caches():
    """Route tables are cached per event loop, and a later test's loop may reuse an id."""
    from speculation.gateway import auth, routes

    routes._caches.clear()
    auth.forget_all()
    yield
    routes._caches.clear()
    auth.forget_all()
