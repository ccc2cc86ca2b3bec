"""The live page at / and the step events it draws from (/v1/engine/steps): the events' format, bounded
memory under a watcher that never reads, missed steps counted only for a watcher's own steps, auth; then
the page itself in headless Chromium (Debian's chromium and chromium-driver, driven by selenium) against a
real server: no console error, a chat that streams and stops, 8 concurrent requests of the max_tokens field
filling the lanes panel and reusing a freed slot (the 3 the page holds back shown as queued in the browser),
gauges that go idle, the KV panel all free afterwards, and a screenshot; a chat that leaves sampling to the
server's defaults and marks a reply cut at max_tokens; the KV map readable from 100 to 100,000 blocks, its
lane colours away from the legend's; throughput timed by the server's clock."""

import collections
import http.client
import json
import os
import shutil
import socket
import time

import pytest
from test_serve import request, wait_metrics

import weights
from config import EngineConfig
from conftest import TINY
from serve import Server
from server import events

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def server():
    """Random weights in a tiny model, 4 slots: 8 requests make lanes wait for a slot and reuse it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(weights.PRESETS, "tiny", TINY)
        s = Server(
            EngineConfig(
                model="tiny",
                dummy_weights=True,
                num_kv_blocks=128,
                device="cpu",
                max_num_seqs=4,
                enable_prefix_caching=True,
                max_model_len=2048,
            ),
            port=0,
            log_requests=False,
        )
        s.start()
        assert s.wait_ready(120)
        yield s
        s.stop()


def step_events(server, headers: dict | None = None):
    """The step stream's events, parsed, as they come; connected (and counted as a watcher) on return."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", "/v1/engine/steps", headers=headers or {})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
    return (json.loads(line[6:]) for line in r if line.startswith(b"data: "))


def test_step_events_format(server):
    events = step_events(server)
    body = {"model": "tiny", "prompt": [5] * 40, "max_tokens": 3, "ignore_eos": True}
    assert request(server, "POST", "/v1/completions", body)[0] == 200
    seen = []
    for e in events:
        seen.append(e)
        if any(lane.get("finished") for lane in e["lanes"]):
            break
    assert {
        "step",
        "t",
        "ms",
        "budget",
        "batch_tokens",
        "lanes",
        "preempted",
        "running",
        "waiting",
        "swapped",
        "preemptions",
        "generated",
        "kv",
    } <= set(seen[0])
    lanes = [lane for e in seen for lane in e["lanes"]]
    assert [lane["kind"] for lane in lanes] == ["prefill", "decode", "decode"]
    assert [lane["kv"] for lane in lanes] == [40, 41, 42] and lanes[-1]["finished"] == "length"
    assert len(lanes[0]["blocks"]) == 3 and lanes[-1]["blocks"] == []  # 40 tokens in blocks of 16; freed
    assert seen[-1]["kv"]["free"] == seen[-1]["kv"]["blocks"] and seen[-1]["kv"]["cached"] == 2
    assert not any("text" in json.dumps(e) or "prompt" in e for e in seen)  # shapes, never content
    # The same 40 tokens again: the two full blocks come from the prefix cache.
    assert request(server, "POST", "/v1/completions", body)[0] == 200
    first = next(lane for e in events for lane in e["lanes"])
    assert first["hit"] == 32 and first["tokens"] == 8


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_a_watcher_that_never_reads_costs_bounded_memory_and_no_step(server):
    sock = socket.create_connection((server.host, server.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET /v1/engine/steps HTTP/1.1\r\nHost: x\r\n\r\n")
    ring, server.steps.ring = server.steps.ring, collections.deque(maxlen=64)  # 512 by default: fewer steps fill it
    try:
        deadline = time.monotonic() + 5
        while server.steps.watchers == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        began = time.monotonic()
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True}
        assert request(server, "POST", "/v1/completions", body)[0] == 200  # 300 steps, each an event
        assert time.monotonic() - began < 60
        assert len(server.steps.ring) == 64
    finally:
        sock.close()
        server.steps.ring = ring


def test_missed_steps_are_only_a_watchers_own(monkeypatch):
    """A watcher is told of the steps it connected for and could not read in time, and of nothing else: not the
    steps that ran while nobody watched, nor those before it came (the events themselves stubbed: just steps)."""
    monkeypatch.setattr(events, "step_event", lambda number, *_: {"step": number})
    steps = events.StepEvents(capacity=4)

    def run(n: int) -> None:
        for _ in range(n):
            steps.publish(None, None, [], 0.0)

    def numbers(texts: list[str]) -> list[int]:
        return [json.loads(t)["step"] for t in texts]

    run(3)  # nobody watches
    old = steps.start()
    run(2)
    assert numbers(steps.read(old, 0)[0]) == [4, 5]
    steps.stop()
    run(10)  # nobody watches again: the ring is not kept for the next watcher
    after = steps.start()
    assert after == 15 and steps.read(after, 0) == ([], 15, 0)
    run(2)
    texts, after, missed = steps.read(after, 0)
    assert numbers(texts) == [16, 17] and after == 17 and missed == 0
    run(7)  # more than the ring holds before this watcher reads again: 3 of them missed
    texts, after, missed = steps.read(after, 0)
    assert numbers(texts) == [21, 22, 23, 24] and missed == 3
    late = steps.start()  # a second watcher, while the first is there: from the next step on, nothing missed
    run(1)
    assert steps.read(late, 0) == (['{"step":25}'], 25, 0)
    assert numbers(steps.read(after, 0)[0]) == [25]


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_a_new_watcher_starts_at_the_next_step_with_nothing_missed(server):
    """Steps that ran while nobody watched, or before this watcher came, are not its missed steps: a page opened
    on a server that has worked a while says nothing of them, and gets no earlier watcher's events either."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True}
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", "/v1/engine/steps")
    r = conn.getresponse()
    assert request(server, "POST", "/v1/completions", body)[0] == 200  # watched: its events fill the ring
    assert any(b'"finished"' in line for line in r)
    conn.close()
    deadline = time.monotonic() + 10  # the server sees the watcher gone at its next write (a comment each second)
    while server.steps.watchers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.steps.watchers == 0
    assert request(server, "POST", "/v1/completions", body)[0] == 200  # 5 steps nobody watches
    first = server.steps.step + 1
    events = step_events(server)
    assert request(server, "POST", "/v1/completions", body)[0] == 200
    seen = []
    for e in events:
        seen.append(e)
        if any(lane.get("finished") for lane in e.get("lanes", [])):
            break
    assert not any("missed" in e for e in seen), seen
    assert [e["step"] for e in seen] == list(range(first, first + 5))


def test_step_events_need_the_api_key(tiny):
    s = Server(
        EngineConfig(model=tiny, dummy_weights=True, num_kv_blocks=16, device="cpu"),
        port=0,
        api_key="sesame",
        log_requests=False,
    )
    s.start()
    try:
        assert s.wait_ready(120)
        assert request(s, "GET", "/v1/engine/steps")[0] == 401
        status, page = request(s, "GET", "/")  # the page is public; it asks for the key
        assert status == 200 and b"This server needs an API key" in page
        events = step_events(s, {"Authorization": "Bearer sesame"})
        ok = {"model": "tiny", "prompt": [1, 2], "max_tokens": 1}
        assert request(s, "POST", "/v1/completions", ok, {"Authorization": "Bearer sesame"})[0] == 200
        assert next(events)["lanes"][0]["kind"] == "prefill"
    finally:
        s.stop()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        if os.environ.get("LANESERVE_REQUIRE_BROWSER"):
            pytest.fail("Chromium and chromedriver are required here (LANESERVE_REQUIRE_BROWSER)")
        pytest.skip("no chromium/chromedriver on this machine (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait(driver, condition, timeout: float = 60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: condition(d))


def attr(driver, element_id: str, name: str) -> int:
    return int(driver.find_element("id", element_id).get_attribute(f"data-{name}"))


def text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def open_page(driver, server):
    driver.get(server.url + "/")
    wait(driver, lambda d: text(d, "model") == "tiny")


def chat(driver, prompt: str, max_tokens: int):
    """Sends a chat and waits for its stats line; the reply's bubble."""
    before = len(driver.find_elements("css selector", ".msg.assistant .meta"))
    driver.find_element("id", "max-tokens").clear()
    driver.find_element("id", "max-tokens").send_keys(str(max_tokens))
    driver.find_element("id", "prompt").send_keys(prompt)
    driver.find_element("id", "send").click()
    wait(driver, lambda d: len(d.find_elements("css selector", ".msg.assistant .meta")) > before)
    return driver.find_elements("css selector", ".msg.assistant")[-1]


RECORD_BODIES = """window.sentBodies = [];
const original = window.fetch;
window.fetch = (url, options) => {
  if (options && options.body) sentBodies.push(JSON.parse(options.body));
  return original(url, options);
};"""


@pytest.mark.slow  # the inner loop keeps a lighter test of its kind
def test_page_in_a_real_browser(server, browser, tmp_path):
    d = browser
    open_page(d, server)
    assert text(d, "g-step") == "idle" and text(d, "g-tps") == "0"
    # A chat streams into the page, with its TTFT and tok/s once done.
    bubble = chat(d, "Hello there", 24)
    reply = bubble.find_element("css selector", ".meta")
    assert "TTFT" in reply.text and "tok/s" in reply.text
    assert bubble.text.strip() != reply.text
    # Stop: a long reply aborted mid-stream frees its lane at once.
    d.find_element("id", "max-tokens").clear()
    d.find_element("id", "max-tokens").send_keys("1900")
    d.find_element("id", "prompt").send_keys("Go on")
    d.find_element("id", "send").click()
    wait(d, lambda d: len(d.find_elements("css selector", ".msg.assistant")[-1].text) > 20)
    wait(d, lambda d: text(d, "g-step").endswith(" ms") and text(d, "g-tps") != "0", timeout=10)  # busy
    d.find_element("id", "stop").click()
    wait(d, lambda d: "stopped" in d.find_elements("css selector", ".msg.assistant .meta")[-1].text)
    m = wait_metrics(server, lambda m: m["num_requests_running"] == 0, timeout=5)
    assert m["num_requests_running"] == 0 and m["kv_cache_usage_perc"] == 0
    wait(d, lambda d: text(d, "g-step") == "idle" and text(d, "g-tps") == "0", timeout=5)
    # 8 concurrent chats on 4 slots: at least 8 lanes drawn, a freed slot taken by a new lane. The page sends
    # 5 at once (the step stream holds a sixth connection) and says the other 3 wait in the browser.
    before = attr(d, "lane-stats", "lanes")
    d.find_element("id", "max-tokens").clear()
    d.find_element("id", "max-tokens").send_keys("48")  # Fire's requests take the field's max_tokens
    d.execute_script(RECORD_BODIES)
    d.find_element("id", "fire").click()
    assert text(d, "g-browser") == "3" and "3 queued in browser" in text(d, "load-status")
    seen = []  # (running, waiting) as the header shows them
    while not (attr(d, "lane-stats", "lanes") >= before + 8 and attr(d, "lane-stats", "reused") >= 1):
        seen.append((int(text(d, "g-running")), int(text(d, "g-waiting"))))
        time.sleep(0.05)
    assert max(r + w for r, w in seen) <= 5
    d.save_screenshot(str(tmp_path / "page.png"))
    wait(d, lambda d: "8 of 8 done" in text(d, "load-status"))
    assert [b["max_tokens"] for b in d.execute_script("return sentBodies")] == [48] * 8
    assert text(d, "g-browser") == "0"
    wait(d, lambda d: attr(d, "kv-stats", "used") == 0, timeout=10)
    # The load over, the gauges say so rather than keep the last step's numbers.
    wait(
        d, lambda d: text(d, "g-step") == "idle" and text(d, "g-tps") == "0" and text(d, "g-running") == "0", timeout=3
    )
    assert os.path.getsize(tmp_path / "page.png") > 10_000
    print(f"screenshot: {tmp_path / 'page.png'}")
    assert 0 < attr(d, "lanes", "rows") <= 300
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_chat_leaves_sampling_to_the_server_and_marks_a_reply_cut_at_max_tokens(server, browser):
    d = browser
    open_page(d, server)
    d.execute_script(RECORD_BODIES)
    for field in ("temperature", "top-p"):
        element = d.find_element("id", field)
        assert element.get_attribute("value") == "" and element.get_attribute("placeholder") == "server default"
    chat(d, "Hello there", 24)
    body = d.execute_script("return sentBodies.at(-1)")
    assert "temperature" not in body and "top_p" not in body and body["max_tokens"] == 24
    # Greedy: the same reply every run, and it runs to max_tokens on these random weights. The chat panel made
    # short, so the reply overflows it; a word wider than the panel must wrap, not push the stats line aside.
    d.find_element("id", "temperature").send_keys("0")
    d.execute_script("document.getElementById('messages').style.height = '150px'")
    bubble = chat(d, "Hi" + "o" * 200, 24)
    assert d.execute_script("return sentBodies.at(-1)")["temperature"] == 0
    assert bubble.get_attribute("data-finish") == "length"
    assert bubble.find_element("css selector", ".cut").text.strip() == "… [cut at max_tokens]"
    meta = bubble.find_element("css selector", ".meta")
    assert "finish_reason length" in meta.text
    # The stats line whole: in the panel's visible area, and nothing runs out of the panel's side.
    inside = d.execute_script(
        """const m = arguments[0].getBoundingClientRect(),
        box = document.getElementById("messages"), b = box.getBoundingClientRect();
        return [m.top >= b.top, m.bottom <= b.bottom + 0.5, m.right <= b.right, box.scrollWidth <= box.clientWidth];""",
        meta,
    )
    assert inside == [True, True, True, True]


DRAW_KV = """const [blocks, used] = arguments;
drawKV({kv: {blocks, free: blocks - used.length, cached: 0, cached_ids: [], swap_used: 0},
        lanes: [{id: "synthetic", blocks: used}], preemptions: 0});
const c = document.getElementById("kv"), px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
const free = [1, 3, 5].map((i) => parseInt(getVar("--free").slice(i, i + 2), 16));
let lit = 0;
for (let i = 0; i < px.length; i += 4)
  if (px[i + 3] && !(px[i] === free[0] && px[i + 1] === free[1] && px[i + 2] === free[2])) lit++;
return {lit, group: +c.dataset.group, per: +c.dataset.per, cell: +c.dataset.cell, dpr: devicePixelRatio,
        width: c.clientWidth, height: c.clientHeight, stats: document.getElementById("kv-stats").textContent};"""


@pytest.mark.parametrize("blocks", [100, 5825, 100_000])
def test_kv_map_readable_from_100_to_100000_blocks(server, browser, blocks):
    """Synthetic steps drawn by the page's own drawKV: 0.3% of the pool used (at least a block), scattered so
    each used block lands in a group of its own, the hardest case for a map that groups blocks."""
    d = browser
    open_page(d, server)
    used = list(range(7, blocks, blocks // max(1, round(blocks * 0.003))))
    kv = d.execute_script(DRAW_KV, blocks, used)
    group, per, cell = kv["group"], kv["per"], kv["cell"]
    assert cell >= 8  # a used block is always at least a 7-pixel square
    assert per * cell <= kv["width"] and -(-blocks // group // per) * cell <= kv["height"]  # the whole pool in view
    assert (group == 1) == (blocks == 100)  # a cell per block while they fit
    side = round((cell - 1) * kv["dpr"])
    assert kv["lit"] == len({b // group for b in used}) * side * side  # each group holding a used block lit, whole
    assert f"{len(used)} of {blocks} blocks in use ({100 * len(used) / blocks:.1f}%)" in kv["stats"]


BACKLOG = """const [t0] = arguments;
for (let i = 0; i < 5; i++)  // five steps a second apart on the server's clock, arriving together
  onStep({step: 1e6 + i, t: t0 + i, ms: 5, budget: 512, batch_tokens: 1, lanes: [], preempted: [], running: 1,
          waiting: 0, swapped: 0, preemptions: 0, generated: 100 * i,
          kv: {blocks: 8, free: 8, cached: 0, cached_ids: [], swap_used: 0}});
gauges(latest, false);
return [rates().map((p) => p[1]), document.getElementById("g-tps").textContent];"""


def test_rates_are_timed_by_the_servers_clock(server, browser):
    """Steps that reach the page together (a backlog) are timed as they ran on the server, not as they arrived:
    100 tokens a second, not a spike."""
    d = browser
    open_page(d, server)
    rates, tps = d.execute_script(BACKLOG, time.monotonic() - 4)  # the server's clock: this process's
    assert rates == [100] * 4 and tps == "100.0"


LANE_HUES = """const legend = LEGEND.map((v) => hue(getVar(v)));
return [legend, Array.from({length: 200}, (_, i) => +laneColour("hue-test-" + i).match(/hsl\\((\\d+)/)[1])];"""


def test_lane_colours_keep_away_from_the_kv_legends(server, browser):
    """A lane's block in the KV map never takes a hue near the cached or swapped colour of the legend."""
    d = browser
    open_page(d, server)
    legend, hues = d.execute_script(LANE_HUES)
    assert len(legend) == 2 and abs(legend[0] - 180) < 5 and abs(legend[1] - 280) < 5  # cyan and purple
    assert all(min(abs(h - x), 360 - abs(h - x)) >= 35 for h in hues for x in legend)
    assert len(set(hues[:8])) == 8 and len(set(hues)) > 60  # still many distinct lane colours


def test_step_events_mark_draft_rows(smollm2_shapes):
    # Speculation: a decode lane's event says how many draft rows it computed and how many were accepted, and
    # its KV grows by the accepted ones only.
    import random

    import test_speculation

    from sequence import SamplingParams

    llm = test_speculation.engine(smollm2_shapes, 4)
    seen = []
    llm.on_step = lambda engine, out, outputs, seconds: seen.append(
        events.step_event(len(seen), engine, out, outputs, seconds)
    )
    llm.generate(
        [test_speculation.looping(random.Random(4), 30)], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    lanes = [e["lanes"][0] for e in seen]
    drafted = [lane for lane in lanes if lane.get("drafts")]
    assert drafted and all(lane["kind"] == "decode" for lane in lanes[1:])
    assert sum(lane["accepted"] for lane in drafted) == llm.num_accepted_tokens > 0
    for before, lane in zip(lanes, lanes[1:]):
        assert lane["kv"] == before["kv"] + lane["tokens"] - lane.get("drafts", 0) + lane.get("accepted", 0)


def test_page_marks_draft_rows(server, browser):
    # A lane that computed draft rows is drawn framed and says accepted/proposed; render draws it without error.
    d = browser
    open_page(d, server)
    got = d.execute_script("""const lane = {id: "spec", kind: "decode", tokens: 5, kv: 50, drafts: 4, accepted: 2};
onStep({step: 2e6, t: 0, ms: 5, budget: 512, batch_tokens: 5, lanes: [lane], preempted: [], running: 1, waiting: 0,
        swapped: 0, preemptions: 0, generated: 3, kv: {blocks: 8, free: 4, cached: 0, cached_ids: [], swap_used: 0}});
render();
return cell(lane);""")
    assert "draft" in got[0].split() and "+5 (2/4 drafts)" in got[1]
