#!/usr/bin/env python3
"""Draws a window of a Chrome trace (psnet-doctor --timeline's, or a PSNET_TIMELINE file) as an
SVG picture: a lane per process and track, a bar per operation, coloured by its kind.

    python3 scripts/timeline-svg.py job.json -o timeline.svg [--start MS] [--length MS] [--title T]

--start: where the window begins, in ms after the trace's first event (default: the middle
of the trace); --length: how long it is (default 40 ms). Standard library only."""

import argparse
import json
import sys
from html import escape

COLOURS = {"push_pull": "#4c78a8", "push": "#f58518", "pull": "#54a24b", "init": "#b279a2",
           "command": "#9d755d"}
LANE, BAR, LEFT, TOP, WIDTH = 22, 14, 260, 40, 1100


def colour(name):
    for kind, c in COLOURS.items():
        if name.startswith(kind):
            return c
    return "#888888"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--start", type=float)
    ap.add_argument("--length", type=float, default=40.0)
    ap.add_argument("--title", help="the picture's title (default: the trace's file name)")
    args = ap.parse_args()
    trace = json.load(open(args.trace))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    bars = [e for e in events if e.get("ph") == "X"]
    if not bars:
        sys.exit("no complete events in the trace")
    t0 = min(e["ts"] for e in bars)
    t1 = max(e["ts"] + e["dur"] for e in bars)
    start = t0 + (args.start * 1000 if args.start is not None else (t1 - t0) / 2)
    end = start + args.length * 1000
    lanes = sorted({(e["pid"], str(e["tid"])) for e in bars})
    height = TOP + LANE * len(lanes) + 50
    scale = WIDTH / (end - start)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           f'<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{LEFT}" y="18" font-size="13">{escape(args.title or args.trace)}: '
           f'{args.length:g} ms from {(start - t0) / 1000:.1f} ms</text>']
    for i, (pid, tid) in enumerate(lanes):
        y = TOP + i * LANE
        label = f"{names.get(pid, pid).split(',')[0]} → {tid}"
        out.append(f'<text x="{LEFT - 6}" y="{y + BAR - 3}" text-anchor="end">{escape(label)}</text>')
        out.append(f'<line x1="{LEFT}" y1="{y + LANE - 4}" x2="{LEFT + WIDTH}" y2="{y + LANE - 4}" '
                   f'stroke="#eeeeee"/>')
        for e in bars:
            if (e["pid"], str(e["tid"])) != (pid, tid):
                continue
            a, b = max(e["ts"], start), min(e["ts"] + e["dur"], end)
            if b < a:
                continue
            x, w = LEFT + (a - start) * scale, max((b - a) * scale, 1.0)
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{BAR}" '
                       f'fill="{colour(e["name"])}"><title>{escape(e["name"])}</title></rect>')
    axis = TOP + LANE * len(lanes) + 10
    for k in range(0, 11):
        x = LEFT + WIDTH * k / 10
        out.append(f'<line x1="{x:.1f}" y1="{axis}" x2="{x:.1f}" y2="{axis + 5}" stroke="black"/>')
        out.append(f'<text x="{x:.1f}" y="{axis + 18}" text-anchor="middle">'
                   f'{args.length * k / 10:g} ms</text>')
    keyx = LEFT
    for kind, c in COLOURS.items():
        out.append(f'<rect x="{keyx}" y="{axis + 26}" width="10" height="10" fill="{c}"/>')
        out.append(f'<text x="{keyx + 14}" y="{axis + 35}">{kind}</text>')
        keyx += 90
    out.append("</svg>")
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"wrote {args.out}: {len(lanes)} lanes")


if __name__ == "__main__":
    main()
