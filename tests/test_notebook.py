"""``attnkit.show`` / ``show_model`` and the example notebooks.

The views are checked against the weights they were given (decoded back from the page), the
models' own weights and, for all-MiniLM-L6-v2, transformers' ``output_attentions``. The example
notebooks run in a real Jupyter kernel (nbclient + ipykernel); their rendered output is then
loaded in headless Chromium, where each embedded explorer must draw its weights on hover.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit
from attnkit import TransformerEncoder, TransformerLM, notebook
from attnkit.notebook import ExplorerView
from attnkit.pages import page
from tests.browser import (
    FLOAT16_ATOL,
    check_focus_lines,
    console_errors,
    hover_token,
    open_page,
    select_layer,
    shown_weights,
)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = ["01_blog_walkthrough", "02_pretrained_attention", "03_lab_model"]


def _srcdoc(markup: str) -> str:
    match = re.fullmatch(r'<iframe class="attnkit-frame" srcdoc="([^"]*)" (.*)</iframe>', markup)
    assert match is not None, markup[:200]
    assert 'sandbox="allow-scripts"' in match.group(2)  # scripts, but no same-origin access
    return html.unescape(match.group(1))


def _weights_in(document: str) -> tuple[list[str], torch.Tensor]:
    """The query tokens and float16 weights ``(layers, H, L, S)`` embedded in an explorer page."""
    match = re.search(r'<script type="application/json" id="attn-data">(.*?)</script>', document)
    assert match is not None
    data = json.loads(match.group(1))
    (first,) = data["inputs"]
    raw = bytearray(base64.b64decode(first["data"]))
    shape = (data["layers"], data["heads"], first["L"], first["S"])
    return first["queryTokens"], torch.frombuffer(raw, dtype=torch.float16).float().reshape(shape)


def _softmax_weights(layers: int, heads: int, length: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    return (torch.randn(layers, heads, length, length, generator=gen) * 3).softmax(-1)


# --------------------------------------------------------------------------- show / show_model


def test_show_weights_embeds_the_explorer_in_a_sandboxed_frame(tmp_path: Path) -> None:
    w = _softmax_weights(2, 3, 5)
    view = attnkit.show(w, list("abcde"), title="five <tokens>", layer=1)
    assert isinstance(view, ExplorerView)
    document = _srcdoc(view._repr_html_())
    assert document == view.page and document.startswith("<!DOCTYPE html>")
    assert "<title>five &lt;tokens&gt;</title>" in document
    tokens, got = _weights_in(document)
    assert tokens == list("abcde")
    torch.testing.assert_close(got, w, atol=FLOAT16_ATOL, rtol=0)
    assert re.findall(r"https?://[^\s\"']+", document) == ["http://www.w3.org/2000/svg"] * 2
    saved = view.save(tmp_path / "deep" / "view.html")
    assert saved.read_text(encoding="utf-8") == view.page


def test_show_runs_an_attnkit_model_on_ids() -> None:
    lm = TransformerLM(40, 16, 2, 4, max_seq_len=32).train()
    ids = torch.randint(0, 40, (7,))
    view = attnkit.show(lm, ids)
    assert lm.training  # the view ran it in eval mode and restored the mode
    lm.eval()
    with torch.no_grad():
        _, want = lm(ids[None], return_weights=True)  # 2 x (1, H, L, L)
    tokens, got = _weights_in(view.page)
    assert tokens == [str(int(i)) for i in ids]
    torch.testing.assert_close(got, torch.stack([x[0] for x in want]), atol=FLOAT16_ATOL, rtol=0)
    assert float(got.triu(diagonal=1).max()) == 0.0  # causal: nothing above the diagonal
    encoder = TransformerEncoder(40, 16, 2, 4, position="rope").eval()
    labelled = attnkit.show(encoder, ids[None], labels=list("abcdefg"))
    with torch.no_grad():
        _, enc_want = encoder(ids[None], return_weights=True)
    tokens, got = _weights_in(labelled.page)
    assert tokens == list("abcdefg")
    torch.testing.assert_close(
        got, torch.stack([x[0] for x in enc_want]), atol=FLOAT16_ATOL, rtol=0
    )


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: attnkit.show(_softmax_weights(1, 2, 3), torch.arange(3)),
            TypeError,
            "got a tensor",
        ),
        (
            lambda: attnkit.show(_softmax_weights(1, 2, 3), list("abc"), labels=list("abc")),
            TypeError,
            "labels= is for a model",
        ),
        (
            lambda: attnkit.show(TransformerLM(9, 8, 1, 2), list("abc")),
            TypeError,
            "tensor of token ids",
        ),
        (
            lambda: attnkit.show(TransformerLM(9, 8, 1, 2), torch.zeros(2, 3, dtype=torch.long)),
            ValueError,
            r"one sequence, got shape \(2, 3\)",
        ),
        (
            lambda: attnkit.show(TransformerLM(9, 8, 1, 2), torch.zeros(3)),
            TypeError,
            "token ids, got Tensor of torch.float32",
        ),
        (
            lambda: attnkit.show(torch.nn.Linear(3, 3), torch.zeros(3, dtype=torch.long)),
            TypeError,
            "return_weights",
        ),
        (
            lambda: attnkit.show(_softmax_weights(1, 2, 3), list("abc"), colour="red"),
            TypeError,
            r"unknown options \['colour'\]",
        ),
        (lambda: attnkit.show(_softmax_weights(1, 2, 3), list("ab")), ValueError, "3 positions"),
        (
            lambda: attnkit.show(_softmax_weights(1, 2, 3), list("abc"), height=50),
            ValueError,
            "height must be an int of at least 100",
        ),
        (lambda: attnkit.show_model(TransformerLM(9, 8, 1, 2), "hi"), TypeError, "pass tokenizer="),
        (lambda: attnkit.show_model(TransformerLM(9, 8, 1, 2), 3), TypeError, "got int"),  # type: ignore[arg-type]
    ],
)
def test_bad_input_is_rejected(call: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()._repr_html_()


def test_show_model_with_a_tokenizer_labels_each_token() -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from attnkit.interop.sentence import bundled_model_path

    tok = tokenizers.Tokenizer.from_file(str(bundled_model_path() / "tokenizer.json"))
    lm = TransformerLM(tok.get_vocab_size(), 16, 2, 2, max_seq_len=64).eval()
    text = "attention is all you need"
    view = attnkit.show_model(lm, text, tokenizer=tok)
    ids = tok.encode(text).ids
    tokens, got = _weights_in(view.page)
    assert tokens == [tok.decode([i]) or str(i) for i in ids] and len(tokens) == len(ids)
    with torch.no_grad():
        _, want = lm(torch.tensor([ids]), return_weights=True)
    torch.testing.assert_close(got, torch.stack([x[0] for x in want]), atol=FLOAT16_ATOL, rtol=0)
    assert f"TransformerLM: {text}" in view.title


def test_show_model_of_the_sentence_encoder_matches_transformers() -> None:
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from attnkit.interop import SentenceEncoder
    from attnkit.interop.sentence import bundled_model_path

    encoder = SentenceEncoder.from_pretrained()
    text = "The cat sat on the mat."
    view = attnkit.show_model(encoder, text, layer=-1)
    tokens, got = _weights_in(view.page)
    path = bundled_model_path()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    bert = transformers.BertModel.from_pretrained(str(path), attn_implementation="eager").eval()
    batch = hf_tok(text, return_tensors="pt")
    with torch.no_grad():
        want = bert(**batch, output_attentions=True).attentions  # 6 x (1, 12, L, L)
    assert tokens == hf_tok.convert_ids_to_tokens(batch["input_ids"][0])
    torch.testing.assert_close(got, torch.stack([x[0] for x in want]), atol=2e-3, rtol=0)
    assert '"initialLayer": 5' in view.page


def test_import_attnkit_loads_the_notebook_views_lazily() -> None:
    code = (
        "import sys, attnkit\n"
        "assert not any(m in sys.modules for m in ('attnkit.notebook', 'attnkit.explorer',"
        " 'attnkit.pages')), sorted(m for m in sys.modules if m.startswith('attnkit'))\n"
        "from attnkit import notebook\n"
        "assert attnkit.show is notebook.show and attnkit.show_model is notebook.show_model\n"
        "assert {'show', 'show_model'} <= set(attnkit.__all__)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert notebook.show is attnkit.show


# --------------------------------------------------------------------------- in the browser


def _frame_lines_match(driver: Any, want: torch.Tensor, layer: int, index: int) -> None:
    """In the current frame: hover query ``index`` and check the lines against ``want``."""
    select_layer(driver, layer)
    hover_token(driver, "q", index)
    check_focus_lines(driver, want, layer, "q", index, list(range(want.shape[1])))


def _wait_ready(driver: Any) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.body && document.body.dataset.ready") == "1"
    )


def test_two_views_on_one_page_do_not_collide(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    a, b = _softmax_weights(2, 3, 6), _softmax_weights(3, 2, 4)
    views = [attnkit.show(a, list("abcdef")), attnkit.show(b, list("wxyz"))]
    # the outer page has its own element named like the explorer's: the frames must not see it
    body = '<svg id="head-svg"></svg>' + "".join(v._repr_html_() for v in views)
    path = tmp_path / "two.html"
    path.write_text(page("two views", body), encoding="utf-8")
    open_page(browser, path, ready=None)
    frames = browser.find_elements(By.CSS_SELECTOR, "iframe.attnkit-frame")
    assert len(frames) == 2
    for frame, want in zip(frames, (a, b), strict=True):
        browser.switch_to.frame(frame)
        try:
            _wait_ready(browser)
            assert browser.execute_script("return attnExplorer.layers") == want.shape[0]
            _frame_lines_match(browser, want, want.shape[0] - 1, 2)
        finally:
            browser.switch_to.default_content()
    assert browser.find_element(By.ID, "head-svg").get_attribute("innerHTML") == ""
    assert console_errors(browser) == []


# --------------------------------------------------------------------------- the example notebooks


def _render(nb: Any) -> str:
    """The notebook as a page: markdown as text, code outputs as Jupyter shows them."""
    parts = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            parts.append(f"<pre class=md>{html.escape(cell.source)}</pre>")
            continue
        parts.append(f"<pre class=code>{html.escape(cell.source)}</pre>")
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/html" in data:
                parts.append(data["text/html"])
            elif out.output_type == "stream":
                parts.append(f"<pre>{html.escape(out.text)}</pre>")
            elif "text/plain" in data:
                parts.append(f"<pre>{html.escape(data['text/plain'])}</pre>")
    return page("notebook", "\n".join(parts))


@pytest.fixture(scope="module", params=NOTEBOOKS)
def executed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The notebook run top to bottom in a fresh Jupyter kernel, and its rendered page."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    if request.param != "01_blog_walkthrough":
        pytest.importorskip("tokenizers")
        pytest.importorskip("tqdm")
    nb = nbformat.read(EXAMPLES / f"{request.param}.ipynb", as_version=4)
    workdir = tmp_path_factory.mktemp(request.param)
    # the kernel inherits the environment: this checkout's attnkit, one thread per kernel (the
    # suite's workers already share the cores)
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS")}
    os.environ["PYTHONPATH"] = os.pathsep.join(sys.path)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        client = nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
        )
        client.execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    rendered = workdir / "rendered.html"
    rendered.write_text(_render(nb), encoding="utf-8")
    return request.param, nb, rendered


@pytest.mark.slow
def test_example_notebook_runs_and_shows_the_explorer(executed: Any) -> None:
    name, nb, _ = executed
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    frames = [
        out.data["text/html"]
        for out in outputs
        if out.output_type == "execute_result" and "text/html" in out.get("data", {})
    ]
    assert len(frames) >= 2, name
    for markup in frames:
        tokens, weights = _weights_in(_srcdoc(markup))
        assert len(tokens) == weights.shape[2] >= 2
        torch.testing.assert_close(
            weights.sum(-1), torch.ones(weights.shape[:3]), atol=3e-3, rtol=0
        )


@pytest.mark.slow
def test_example_notebook_output_works_in_the_browser(browser, executed: Any) -> None:
    from selenium.webdriver.common.by import By

    name, _, rendered = executed
    open_page(browser, rendered, ready=None)
    frames = browser.find_elements(By.CSS_SELECTOR, "iframe.attnkit-frame")
    assert len(frames) >= 2, name
    for frame in frames:
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", frame)
        browser.switch_to.frame(frame)
        try:
            _wait_ready(browser)
            # the weights the page decoded are what the lines must show
            shown = shown_weights(browser)
            layer = int(browser.find_element(By.ID, "layer-select").get_attribute("value"))
            _frame_lines_match(browser, shown, layer, 1)
        finally:
            browser.switch_to.default_content()
    assert console_errors(browser) == []
