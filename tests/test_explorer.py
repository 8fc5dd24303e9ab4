"""The attention explorer: its encoding and errors in Python, and what it draws in a real browser.

The browser tests drive headless Chromium (``tests/browser.py``) and compare what is drawn (SVG
lines, heatmap pixels, hover read-outs) with the weights that went in.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from attnkit import TransformerEncoder
from attnkit.explorer import (
    MAX_TOKENS,
    ExplorerInput,
    ExplorerOptions,
    explorer_html,
    explorer_page,
    stack_weights,
    write_explorer,
)
from tests.browser import (
    FLOAT16_ATOL,
    LINES_JS,
    check_focus_lines,
    console_errors,
    hover_token,
    open_page,
    select_layer,
    shown_weights,
)

TOKENS = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]


def _weights(layers: int, heads: int, L: int, S: int | None = None, seed: int = 0) -> torch.Tensor:
    """Peaked random attention weights (rows sum to 1), so each row has a clear argmax."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(layers, heads, L, S or L, generator=gen) * 3
    return scores.softmax(-1)  # (layers, H, L, S)


def _payload(page: str, index: int = 0) -> dict[str, Any]:
    """The page's embedded data, with the fields of input ``index`` merged in."""
    match = re.search(r'<script type="application/json" id="attn-data">(.*?)</script>', page, re.S)
    assert match is not None
    data = json.loads(match.group(1))
    return {**data, **data["inputs"][index]}


def _decode(payload: dict[str, Any]) -> torch.Tensor:
    raw = bytearray(base64.b64decode(payload["data"]))
    shape = (payload["layers"], payload["heads"], payload["L"], payload["S"])
    if payload["encoding"] == "float16":
        return torch.frombuffer(raw, dtype=torch.float16).float().reshape(shape)
    scales = torch.tensor(payload["scales"])[..., None, None]  # (layers, H, 1, 1)
    return torch.frombuffer(raw, dtype=torch.uint8).float().reshape(shape) / 255 * scales


# --------------------------------------------------------------------------- Python side


@pytest.mark.parametrize("precision", ["float16", "uint8"])
def test_embedded_weights_round_trip(precision: str) -> None:
    w = _weights(2, 3, 7)
    payload = _payload(explorer_html(TOKENS[:7], w, precision=precision))  # type: ignore[arg-type]
    assert payload["encoding"] == precision
    assert payload["queryTokens"] == TOKENS[:7] == payload["keyTokens"]
    got = _decode(payload)
    if precision == "float16":
        torch.testing.assert_close(got, w, atol=FLOAT16_ATOL, rtol=0)
    else:
        bound = w.amax(dim=(-2, -1), keepdim=True) / 510 + 1e-7  # half a quantization step
        assert ((got - w).abs() <= bound).all()


def test_auto_precision_switches_to_uint8_for_large_inputs() -> None:
    assert _payload(explorer_html(TOKENS, _weights(1, 2, 9)))["encoding"] == "float16"
    big = _weights(2, 8, 512)  # 4.2M weights
    tokens = [f"t{i}" for i in range(512)]
    page = explorer_html(tokens, big)
    assert _payload(page)["encoding"] == "uint8"
    assert len(page) < 1.45 * big.numel()  # ~4/3 byte per weight (base64 of one byte)


def test_page_is_self_contained_and_reports_its_size(tmp_path: Path) -> None:
    path = write_explorer(tmp_path / "sub" / "e.html", TOKENS, _weights(1, 2, 9), title="T<i>")
    page = path.read_text(encoding="utf-8")
    # nothing is fetched: no external scripts, styles, images or imports
    for pattern in (r"<script[^>]*\bsrc=", r"<link\b", r"<img\b", r"@import", r"url\(", r"fetch\("):
        assert re.search(pattern, page) is None, pattern
    assert re.findall(r"https?://[^\s\"']+", page) == ["http://www.w3.org/2000/svg"] * 2
    assert "<title>T&lt;i&gt;</title>" in page
    size = re.search(r'<span id="page-size">([0-9.]+) KB</span>', page)
    assert size is not None
    assert abs(float(size.group(1)) * 1024 - path.stat().st_size) <= 0.05 * 1024 + 1


def test_write_explorer_hands_on_every_option(tmp_path: Path) -> None:
    w = _weights(2, 2, 3, 4)
    options: ExplorerOptions = {
        "key_tokens": list("wxyz"),
        "title": "cross",
        "description": "three queries, four keys",
        "layer_names": ["enc", "dec"],
        "layer": -1,
        "precision": "uint8",
    }
    page = write_explorer(tmp_path / "e.html", list("abc"), w, **options).read_text("utf-8")
    assert page == explorer_html(list("abc"), w, **options)
    payload = _payload(page)
    assert (payload["keyTokens"], payload["layerNames"]) == (list("wxyz"), ["enc", "dec"])
    assert (payload["title"], payload["description"]) == ("cross", "three queries, four keys")
    assert (payload["initialLayer"], payload["encoding"]) == (1, "uint8")
    with pytest.raises(TypeError, match="colour"):
        write_explorer(tmp_path / "f.html", list("abc"), w, colour="red")  # type: ignore[call-arg]


def test_tokens_cannot_break_out_of_the_page() -> None:
    tokens = ["</script><script>alert(1)</script>", "{size}", "\u0000", "a"]
    page = explorer_html(tokens, _weights(1, 1, 4))
    assert page.count("</script>") == 2  # the data block's and the code's own
    assert _payload(page)["queryTokens"] == tokens


def test_accepts_what_attnkit_models_return() -> None:
    model = TransformerEncoder(50, 16, 2, 4, position="sinusoidal").eval()
    with torch.no_grad():
        _, weights = model(torch.randint(0, 50, (1, 6)), return_weights=True)  # 2 x (1, 4, 6, 6)
    stacked = stack_weights(weights)
    assert stacked.shape == (2, 4, 6, 6)
    torch.testing.assert_close(stacked, torch.stack([w[0] for w in weights]))
    torch.testing.assert_close(stack_weights(torch.stack(weights)), stacked)  # (layers, 1, H, L, S)
    payload = _payload(explorer_html([str(i) for i in range(6)], weights))
    torch.testing.assert_close(_decode(payload), stacked, atol=FLOAT16_ATOL, rtol=0)


def test_a_soft_capped_model_shows_its_capped_weights() -> None:
    # Gemma 2's soft-capping changes the weights: the explorer shows what the layers computed
    # with the cap, equal to the capped float64 math on the layers' own queries and keys.
    from attnkit import TransformerConfig, TransformerLM
    from tests.reference import loop_mask, reference_attention

    config = TransformerConfig(
        vocab_size=50, dim=32, num_layers=2, num_heads=4, norm="rmsnorm", attn_softcap=1.5
    )
    torch.manual_seed(0)
    model = TransformerLM(config).eval()
    seen: list[tuple[Tensor, Tensor, Tensor]] = []
    for block in model.blocks:
        kernel = block.attention.kernel

        def record(q, k, v, *args, kernel=kernel, **kw):
            seen.append((q.detach(), k.detach(), v.detach()))
            return kernel(q, k, v, *args, **kw)

        block.attention.kernel = record
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        _, weights = model(ids, return_weights=True)
    shown = _decode(_payload(explorer_html([str(i) for i in range(9)], weights)))
    allowed = loop_mask(9, 9, causal=True)
    capped = torch.stack([reference_attention(*t, allowed, softcap=1.5)[1][0] for t in seen])
    plain = torch.stack([reference_attention(*t, allowed)[1][0] for t in seen])
    torch.testing.assert_close(shown.double(), capped, atol=FLOAT16_ATOL, rtol=0)
    assert (shown.double() - plain).abs().max() > 100 * FLOAT16_ATOL  # the cap shows


def test_initial_layer() -> None:
    w = _weights(3, 1, 4)
    assert _payload(explorer_html(list("abcd"), w))["initialLayer"] == 0
    assert _payload(explorer_html(list("abcd"), w, layer=-1))["initialLayer"] == 2
    with pytest.raises(ValueError, match=r"layer must be an int in \[-3, 2\], got 3"):
        explorer_html(list("abcd"), w, layer=3)


def test_cross_attention_takes_key_tokens() -> None:
    w = _weights(1, 2, 3, 5)
    payload = _payload(explorer_html(["a", "b", "c"], w, key_tokens=list("vwxyz")))
    assert (payload["L"], payload["S"]) == (3, 5) and payload["keyTokens"] == list("vwxyz")


@pytest.mark.parametrize(
    ("tokens", "weights", "kwargs", "error", "match"),
    [
        (TOKENS, _weights(1, 2, 9)[0], {}, ValueError, r"\(layers, H, L, S\).*\(2, 9, 9\)"),
        (TOKENS, [torch.rand(2, 2, 9, 9)], {}, ValueError, r"batch of 2 examples"),
        (TOKENS, [torch.rand(2, 9, 9), torch.rand(3, 9, 9)], {}, ValueError, r"same \(H, L, S\)"),
        (TOKENS, [], {}, ValueError, "empty"),
        (TOKENS, [[0.5]], {}, TypeError, r"must be tensors, got \['list'\]"),
        (TOKENS, "weights", {}, TypeError, "got str"),
        (TOKENS[:8], _weights(1, 2, 9), {}, ValueError, "tokens has 8 tokens .* 9 positions"),
        ("the cat", _weights(1, 2, 9), {}, TypeError, "list of strings"),
        (["a", "b"], _weights(1, 2, 2, 3), {}, ValueError, "pass key_tokens: .* L=2 .* S=3"),
        (["a"], _weights(1, 1, 1), {}, ValueError, r"2 to 512 tokens, got L \(queries\) = 1"),
        (
            [str(i) for i in range(MAX_TOKENS + 1)],
            torch.full((1, 1, 513, 513), 1 / 513),
            {},
            ValueError,
            "got L",
        ),
        (["a", "b"], torch.tensor([[[[0.5, float("nan")], [1.0, 0.0]]]]), {}, ValueError, "NaN"),
        (["a", "b"], torch.full((1, 1, 2, 2), 1.5), {}, ValueError, r"\[0, 1\].*max 1\.5"),
        (TOKENS, _weights(1, 2, 9), {"precision": "bf16"}, ValueError, "precision .* 'bf16'"),
        (TOKENS, _weights(2, 2, 9), {"layer_names": ["x"]}, ValueError, "1 names for 2 layers"),
    ],
)
def test_bad_input_is_rejected(tokens, weights, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        explorer_html(tokens, weights, **kwargs)


def test_several_inputs_in_one_page() -> None:
    a, b = _weights(2, 3, 4, seed=3), _weights(2, 3, 6, 5, seed=4)
    page = explorer_page(
        [
            ExplorerInput(list("abcd"), a, label="first", note="accuracy 1.0"),
            ExplorerInput(list("uvwxyz"), list(b), key_tokens=list("VWXYZ")),
        ],
        layer=1,
    )
    first, second = _payload(page, 0), _payload(page, 1)
    assert (first["label"], first["note"], second["label"]) == ("first", "accuracy 1.0", "input 1")
    assert (second["L"], second["S"], second["keyTokens"]) == (6, 5, list("VWXYZ"))
    torch.testing.assert_close(_decode(first), a, atol=FLOAT16_ATOL, rtol=0)
    torch.testing.assert_close(_decode(second), b, atol=FLOAT16_ATOL, rtol=0)
    assert "2 inputs of up to 6 tokens, 2 layers x 3 heads" in page
    assert 'id="input-chooser" hidden' not in page
    assert 'id="input-chooser" hidden' in explorer_html(list("abcd"), a)  # one input: no selector
    with pytest.raises(ValueError, match=r"same \(layers, heads\), got \[\(1, 3\), \(2, 3\)\]"):
        explorer_page([ExplorerInput(list("abcd"), a), ExplorerInput(list("abcd"), a[:1])])
    with pytest.raises(ValueError, match="empty"):
        explorer_page([])
    with pytest.raises(TypeError, match=r"inputs\[1\] must be an ExplorerInput, got tuple"):
        explorer_page([ExplorerInput(list("abcd"), a), (list("abcd"), a)])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="list of ExplorerInput"):
        explorer_page(ExplorerInput(list("abcd"), a))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- in the browser


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    w = _weights(3, 4, len(TOKENS), seed=1)
    path = write_explorer(tmp_path_factory.mktemp("explorer") / "small.html", TOKENS, list(w))
    return path, w


def test_head_view_draws_the_hovered_tokens_attention(browser, small) -> None:
    path, w = small
    open_page(browser, path)
    # nothing selected on a small input: a faint overview of every head's lines
    overview = browser.execute_script(LINES_JS)
    assert overview and {line["cls"] for line in overview} == {"overview"}
    for layer in (0, 2, 1):
        select_layer(browser, layer)
        for index in (0, 4, 8):
            hover_token(browser, "q", index)
            check_focus_lines(browser, w, layer, "q", index, [0, 1, 2, 3])
            hover_token(browser, "k", index)  # the other direction: who attends to this key
            check_focus_lines(browser, w, layer, "k", index, [0, 1, 2, 3])
    info = browser.find_element("id", "selection-info").text
    best = int(w[1, 0, :, 8].argmax())
    assert info.startswith("Key 8 “[SEP]”, layer 1") and f"head 0: {TOKENS[best]}" in info
    assert console_errors(browser) == []


def test_head_toggles_pin_and_relative_scale(browser, small) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    path, w = small
    open_page(browser, path)
    toggles = browser.find_elements(By.CSS_SELECTOR, "button.head-toggle")
    assert [t.get_attribute("aria-pressed") for t in toggles] == ["true"] * 4
    toggles[1].click()
    toggles[3].click()
    assert toggles[1].get_attribute("aria-pressed") == "false"
    hover_token(browser, "q", 2)
    check_focus_lines(browser, w, 0, "q", 2, [0, 2])
    browser.find_element(By.ID, "heads-none").click()
    assert browser.execute_script(LINES_JS) == []
    browser.find_element(By.ID, "heads-all").click()  # the pointer leaves the token: hover again
    hover_token(browser, "q", 2)
    check_focus_lines(browser, w, 0, "q", 2, [0, 1, 2, 3])
    # click pins the token: moving away keeps its lines
    browser.find_elements(By.CSS_SELECTOR, "#query-tokens .token")[5].click()
    ActionChains(browser).move_to_element(browser.find_element(By.TAG_NAME, "h1")).perform()
    check_focus_lines(browser, w, 0, "q", 5, [0, 1, 2, 3])
    # relative scale: each head's largest weight is drawn fully opaque
    browser.find_element(By.ID, "relative-scale").click()
    lines = browser.execute_script(LINES_JS)
    for h in range(4):
        own = [line for line in lines if line["head"] == h]
        top = max(own, key=lambda line: line["opacity"])
        assert top["opacity"] == pytest.approx(1.0) and top["key"] == int(w[0, h, 5].argmax())
        for line in own:
            ratio = float(w[0, h, 5, line["key"]] / w[0, h, 5].max())
            assert line["opacity"] == pytest.approx(ratio, abs=1e-3)
    assert console_errors(browser) == []


_CELL_COLOURS_JS = """
const c = document.getElementById('detail-canvas'), d = c.dataset;
const ctx = c.getContext('2d'), dpr = +d.dpr, cell = +d.cell, out = [];
for (let i = 0; i < arguments[0]; i++) {
  const row = [];
  for (let j = 0; j < arguments[1]; j++) {
    const x = Math.floor((+d.left + (j + 0.5) * cell) * dpr);
    const y = Math.floor((+d.top + (i + 0.5) * cell) * dpr);
    // sample off the printed number, which sits in the middle of the cell
    const p = ctx.getImageData(x - Math.floor(cell * dpr * 0.4), y, 1, 1).data;
    row.push([p[0], p[1], p[2]]);
  }
  out.push(row);
}
return out;
"""


def _viridis(values: torch.Tensor) -> torch.Tensor:
    colormaps = pytest.importorskip("matplotlib").colormaps

    rgba = colormaps["viridis"](values.numpy())
    return torch.tensor(rgba[..., :3] * 255)


def _open_map(driver: Any, layer: int, head: int) -> Any:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "tab-model").click()
    thumb = driver.find_element(
        By.CSS_SELECTOR, f'canvas.thumb[data-layer="{layer}"][data-head="{head}"]'
    )
    thumb.click()
    return driver.find_element(By.ID, "detail-canvas")


def _hover_cell(driver: Any, canvas: Any, i: int, j: int) -> dict[str, str]:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    geo = driver.execute_script("return arguments[0].dataset", canvas)
    size = canvas.size  # offsets are from the element's centre
    cell = float(geo["cell"])
    dx = float(geo["left"]) + (j + 0.5) * cell - size["width"] / 2
    dy = float(geo["top"]) + (i + 0.5) * cell - size["height"] / 2
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    ActionChains(driver).move_to_element_with_offset(canvas, int(dx), int(dy)).perform()
    info = driver.find_element(By.ID, "detail-info")
    return driver.execute_script(
        "return Object.assign({text: arguments[0].textContent}, arguments[0].dataset)", info
    )


def test_model_view_heatmaps_match_the_weights(browser, small) -> None:
    from selenium.webdriver.common.by import By

    path, w = small
    open_page(browser, path)
    browser.find_element(By.ID, "tab-model").click()
    thumbs = browser.find_elements(By.CSS_SELECTOR, "canvas.thumb")
    assert len(thumbs) == 3 * 4
    for thumb in thumbs:
        layer, head = int(thumb.get_attribute("data-layer")), int(thumb.get_attribute("data-head"))
        peak = float(thumb.get_attribute("data-max"))
        assert peak == pytest.approx(float(w[layer, head].max()), abs=FLOAT16_ATOL)
    for layer, head in ((2, 1), (0, 3)):
        canvas = _open_map(browser, layer, head)
        assert canvas.get_attribute("data-layer") == str(layer)
        assert browser.find_element(By.ID, "detail-title").text == f"layer {layer}, head {head}"
        # every cell's colour is viridis(weight / the map's max), as in the static pictures
        drawn = torch.tensor(browser.execute_script(_CELL_COLOURS_JS, len(TOKENS), len(TOKENS)))
        want = _viridis(w[layer, head] / w[layer, head].max())
        assert (drawn.double() - want).abs().max() <= 8  # the page interpolates 9 viridis stops
        brightest = int(drawn.sum(-1).flatten().argmax())
        assert brightest == int(w[layer, head].flatten().argmax())
        # hovering a cell reads out its exact weight and tokens
        for i, j in ((0, 0), (3, 7), (8, 2)):
            info = _hover_cell(browser, canvas, i, j)
            assert (int(info["query"]), int(info["key"])) == (i, j)
            assert float(info["weight"]) == pytest.approx(
                float(w[layer, head, i, j]), abs=FLOAT16_ATOL
            )
            text = re.fullmatch(
                r"query (\d+) “(.*)” → key (\d+) “(.*)”: weight ([0-9.]+)", info["text"]
            )
            assert text is not None
            assert text.group(1, 2, 3, 4) == (str(i), TOKENS[i], str(j), TOKENS[j])
            assert float(text.group(5)) == pytest.approx(float(w[layer, head, i, j]), abs=3e-4)
    assert console_errors(browser) == []


def test_input_selector_switches_both_views(browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    a, b = _weights(2, 3, 5, seed=5), _weights(2, 3, 7, seed=6)
    path = tmp_path / "inputs.html"
    path.write_text(
        explorer_page(
            [
                ExplorerInput(list("abcde"), a, label="short", note="the short one"),
                ExplorerInput(list("ABCDEFG"), b, label="long", note="the long one"),
            ]
        ),
        encoding="utf-8",
    )
    open_page(browser, path)
    chooser = Select(browser.find_element(By.ID, "input-select"))
    assert [o.text for o in chooser.options] == ["short", "long"]
    assert browser.find_element(By.ID, "input-note").text == "the short one"
    hover_token(browser, "q", 1)
    check_focus_lines(browser, a, 0, "q", 1, [0, 1, 2])
    browser.find_element(By.ID, "tab-model").click()
    _open_map(browser, 1, 2)
    browser.find_element(By.ID, "tab-head").click()
    chooser.select_by_visible_text("long")
    assert browser.find_element(By.ID, "input-note").text == "the long one"
    assert browser.execute_script(
        "return [attnExplorer.input, attnExplorer.L, attnExplorer.S]"
    ) == [
        1,
        7,
        7,
    ]
    shown = browser.execute_script(
        "return Array.from(document.querySelectorAll('#key-tokens .token text'))"
        ".map((t) => t.textContent)"
    )
    assert shown == list("ABCDEFG")
    select_layer(browser, 1)
    hover_token(browser, "q", 6)
    check_focus_lines(browser, b, 1, "q", 6, [0, 1, 2])
    # the model view follows: thumbnails and the open map are the new input's
    browser.find_element(By.ID, "tab-model").click()
    peaks = {
        (int(t.get_attribute("data-layer")), int(t.get_attribute("data-head"))): float(
            t.get_attribute("data-max")
        )
        for t in browser.find_elements(By.CSS_SELECTOR, "canvas.thumb")
    }
    assert peaks == pytest.approx(
        {(lay, h): float(b[lay, h].max()) for lay in range(2) for h in range(3)}, abs=FLOAT16_ATOL
    )
    canvas = browser.find_element(By.ID, "detail-canvas")  # the open map is redrawn too
    assert float(canvas.get_attribute("data-max")) == pytest.approx(
        float(b[1, 2].max()), abs=FLOAT16_ATOL
    )
    info = _hover_cell(browser, canvas, 6, 3)
    assert float(info["weight"]) == pytest.approx(float(b[1, 2, 6, 3]), abs=FLOAT16_ATOL)
    assert console_errors(browser) == []


@pytest.mark.slow
def test_512_tokens_quantized(browser, tmp_path: Path) -> None:
    """The largest input: 512 tokens, uint8 weights, canvas heatmaps at one pixel per cell."""
    w = _weights(2, 3, 512, seed=2)
    tokens = [f"tok{i}" for i in range(512)]
    path = write_explorer(tmp_path / "big.html", tokens, w, precision="uint8")
    open_page(browser, path, timeout=60)
    decoded = torch.tensor(
        browser.execute_script(
            "const e = window.attnExplorer; const out = [];"
            "for (const [l, h, i] of [[0, 0, 0], [1, 2, 300], [1, 1, 511]]) {"
            "  const row = []; for (let j = 0; j < e.S; j++) row.push(e.weight(l, h, i, j));"
            "  out.push(row); } return out;"
        )
    )
    for row, (layer, head, i) in zip(decoded, [(0, 0, 0), (1, 2, 300), (1, 1, 511)], strict=True):
        assert (row - w[layer, head, i]).abs().max() <= float(w[layer, head].max()) / 510 + 1e-6
    select_layer(browser, 1)
    browser.execute_script(
        "document.querySelectorAll('#query-tokens .token')[300].scrollIntoView({block: 'center'})"
    )
    hover_token(browser, "q", 300)
    lines = browser.execute_script(LINES_JS)
    for h in range(3):
        own = [line for line in lines if line["head"] == h]
        brightest = max(own, key=lambda line: line["opacity"])
        assert brightest["key"] == int(w[1, h, 300].argmax()) and brightest["opacity"] == 1.0
    canvas = _open_map(browser, 1, 2)
    assert canvas.get_attribute("data-cell") == "2"  # 1024 px: the page scrolls
    i, j = 300, int(w[1, 2, 300].argmax())
    info = _hover_cell(browser, canvas, i, j)
    got_i, got_j = int(info["query"]), int(info["key"])
    assert abs(got_i - i) <= 1 and abs(got_j - j) <= 1  # pointer offsets are whole pixels
    want = float(w[1, 2, got_i, got_j])
    assert float(info["weight"]) == pytest.approx(want, abs=float(w[1, 2].max()) / 510 + 1e-6)
    assert console_errors(browser) == []


# --------------------------------------------------------------------------- pages of the CLI


@pytest.mark.slow
def test_explain_pages_in_the_browser(browser, tmp_path: Path) -> None:
    """``attnkit explain`` with two sentences: one explorer per sentence plus a similarity view."""
    from selenium.webdriver.common.by import By

    pytest.importorskip("tokenizers")
    from attnkit.commands import explain
    from attnkit.interop import SentenceEncoder

    texts = ["The cat sat on the mat.", "A dog slept on the rug."]
    parser = argparse.ArgumentParser()
    explain.add_arguments(parser)
    assert explain.run(parser.parse_args([*texts, "--out", str(tmp_path)])) == 0
    encoder = SentenceEncoder.from_pretrained()
    for k, text in enumerate(texts):
        tokens, weights = encoder.attention_weights(text)  # (layers, heads, L, L)
        page = tmp_path / f"text-{k}" / "explorer.html"
        assert 'href="explorer.html"' in (page.parent / "index.html").read_text(encoding="utf-8")
        open_page(browser, page)
        shown = browser.execute_script(
            "return Array.from(document.querySelectorAll('#query-tokens .token title'))"
            ".map((t) => t.textContent)"
        )
        assert shown == [f"query {i}: {t}" for i, t in enumerate(tokens)]
        select_layer(browser, 4)
        hover_token(browser, "q", 2)
        check_focus_lines(browser, weights, 4, "q", 2, list(range(weights.shape[1])))
        assert console_errors(browser) == []
    open_page(browser, tmp_path / "index.html", ready=None)
    cells = browser.find_elements(By.CSS_SELECTOR, "td.sim")
    emb = encoder.encode(texts)
    got = {(int(c.get_attribute("data-i")), int(c.get_attribute("data-j"))): c for c in cells}
    assert set(got) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for (i, j), cell in got.items():
        assert float(cell.text) == pytest.approx(float(emb[i] @ emb[j]), abs=1e-3)
    links = [a.get_attribute("href") for a in browser.find_elements(By.CSS_SELECTOR, "td.text a")]
    assert links[0].endswith("text-0/explorer.html") and links[2].endswith("text-1/explorer.html")
    assert console_errors(browser) == []


@pytest.mark.slow
def test_lab_report_links_the_explorer_of_the_trained_model(browser, tmp_path: Path) -> None:
    """``attnkit lab --compare-pe``: report.html links explorer.html (the main run) and one
    explorer per compared encoder; the pages show the trained models' weights on the input."""
    from selenium.webdriver.common.by import By

    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    from selenium.webdriver.support.ui import Select

    from attnkit.lab.report import EXPLORER_INPUTS
    from attnkit.lab.runner import run_lab
    from attnkit.lab.train import LabConfig, attention_weights, load_trained

    config = LabConfig(seq_len=8, dim=16, ffn_dim=32, steps=30, eval_size=50, eval_every=0)
    metrics = run_lab(config, out_dir=tmp_path, compare_pe=True, progress=False)
    assert metrics["explorers"] == {
        "sinusoidal": "explorer.html",
        "none": "explorer-none.html",
        "rope": "explorer-rope.html",
    }
    open_page(browser, tmp_path / "report.html", ready=None)
    links = browser.find_elements(By.CSS_SELECTOR, "p.explorer a")
    assert [a.get_attribute("href").rsplit("/", 1)[-1] for a in links] == [
        "explorer.html",
        "explorer-none.html",
        "explorer-rope.html",
    ]
    task = config.make_task()
    ids_of = {label: i for i, label in enumerate(task.labels(range(task.vocab_size)))}
    for name, file in metrics["explorers"].items():
        open_page(browser, tmp_path / file)
        model, _, _ = load_trained(tmp_path / f"pe-{name}")
        count = browser.execute_script("return window.attnExplorer.inputs")
        assert count == EXPLORER_INPUTS
        labels = [o.text for o in Select(browser.find_element(By.ID, "input-select")).options]
        for k in (0, count - 1):
            browser.execute_script(f"window.attnExplorer.selectInput({k})")
            tokens = browser.execute_script(
                "return Array.from(document.querySelectorAll('#query-tokens .token title'))"
                ".map((t) => t.textContent.replace(/^query \\d+: /, ''))"
            )
            assert [int(t.split(":")[0]) for t in tokens] == list(range(len(tokens)))
            ids = torch.tensor([[ids_of[t.split(":")[1]] for t in tokens]])  # a held-out input
            want = attention_weights(model, ids)[0]  # (layers, H, L, L), live from the checkpoint
            got = shown_weights(browser)
            torch.testing.assert_close(got, want, atol=FLOAT16_ATOL, rtol=0)
            # the selector names the model's accuracy on this input, computed here afresh
            with torch.no_grad():
                right = int((model(ids).argmax(-1) == ids.flip(-1)).sum())  # reverse's target
            want_label = f"input {k}: {right / len(tokens):.0%} of {len(tokens)} right"
            assert labels[k].startswith(want_label), (labels[k], want_label)
            layer = int(browser.find_element(By.ID, "layer-select").get_attribute("value"))
            if file == "explorer.html":  # the main run opens on its best head's layer
                assert layer == metrics["attention"]["best_layer"]
            hover_token(browser, "q", 3)
            check_focus_lines(browser, want, layer, "q", 3, list(range(want.shape[1])))
        assert console_errors(browser) == []


@pytest.mark.parametrize(("ci", "outcome"), [("true", "Failed"), ("", "Skipped")])
def test_a_missing_browser_skips_except_in_ci(monkeypatch, ci: str, outcome: str) -> None:
    from tests import browser as helper

    monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(helper, "CHROMIUM_CANDIDATES", ("/nonexistent/chromium",))
    monkeypatch.setattr(helper.shutil, "which", lambda name: None)
    with pytest.raises(BaseException) as caught:  # pytest's Failed/Skipped outcomes
        helper.start_browser()
    assert type(caught.value).__name__ == outcome
    assert "chromium or chromedriver is missing" in str(caught.value)
