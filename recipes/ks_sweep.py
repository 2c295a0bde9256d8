#!/usr/bin/env python3
# The INT4 expert GEMMs' K split swept with SPECLAB_W4_KS (recipes/ab_session.sh legs, one
# bench moe record a forced split): experts us per routing and M for each split beside the
# default rule's, the best split of each row, and the row's tiles and items (row-block
# groups x tiles at each split; GLM-5.3-Flash gate/up and down both have 64 row blocks).
#   python3 recipes/ks_sweep.py runs/ab-<commit>
import json, math, os, sys
D = sys.argv[1]
legs = {}
i = 1
while os.path.exists(os.path.join(D, f'env-ab{i}.txt')):
    env = open(os.path.join(D, f'env-ab{i}.txt')).read().strip()
    f = os.path.join(D, f'bench-moe-ab{i}.json')
    if env.startswith('SPECLAB_W4_KS=') and os.path.exists(f):
        legs[int(env.split('=')[1])] = json.load(open(f))
    i += 1
base = json.load(open(os.path.join(D, 'bench-moe.json')))
ks = sorted(legs)
rows = {(r['routing'], r['m']): r for r in base['rows']}
print('| routing | M | tiles | default | ' + ' | '.join(f'ks {k}' for k in ks) + ' | best |')
print('|---|---|---|---|' + '---|' * len(ks) + '---|')
for key, r in rows.items():
    t = {k: {(x['routing'], x['m']): x for x in legs[k]['rows']}[key]['experts_us'] for k in ks}
    best = min(t, key=t.get)
    items = ' / '.join(str(math.ceil(8 * k * r['tiles'])) for k in ks)
    print(f"| {key[0]} | {key[1]} | {r['tiles']:.1f} | {r['experts_us']:.1f} | " +
          ' | '.join(f"{t[k]:.1f}" for k in ks) + f" | {best} ({t[best] / r['experts_us']:.2f}x; items {items}) |")
