#!/usr/bin/env python3
# The A/B tables of one device call's records (runs/ab-<commit>/, recipes/ab_session.sh):
# graphed decode GPU us a step and kernels a step (gpu_check) per leg, then bench e2e no
# drafter tok/s with MTP N = 2 / DFlash2 N = 7 as multiples of it, per concurrency.
#   python3 recipes/ab_table.py runs/ab-<commit>
import json,sys,os
D=sys.argv[1]
def gpu(f):
    t=json.load(open(os.path.join(D,f)))['timing']
    return {x['batch']:(x['gpu_us_per_step'],int(x['kernels_per_step'])) for x in t if x['graphs']}
def e2e(f):
    r=json.load(open(os.path.join(D,f)))
    out={}
    for x in r['rows']:
        if x['graphs']:
            out[(x['drafter'],x.get('num_spec',0),x['concurrency'])]=x['decode_tok_s']
    return out
legs=[('defaults','gpu-check.json','bench-e2e.json')]
i=1
while os.path.exists(os.path.join(D,f'env-ab{i}.txt')):
    legs.append((open(os.path.join(D,f'env-ab{i}.txt')).read().strip(),f'gpu-check-ab{i}.json',f'bench-e2e-ab{i}.json')); i+=1
for name,g,e in legs:
    G=gpu(g)
    print(f"| {name} | "+" / ".join(f"{G[b][0]:.1f}" for b in (1,8,32,128))+f" | {G[1][1]} |")
for name,g,e in legs:
    try: E=e2e(e)
    except Exception as ex: print(name, 'e2e?', ex); continue
    none={c:E[k] for k in E for c in [k[2]] if k[0]=='none'}
    cells=[]
    for c in (1,8,32,128):
        n=none.get(c)
        m=[E[k] for k in E if k[2]==c and k[0]=='mtp' and k[1]==2]
        d=[E[k] for k in E if k[2]==c and k[0]=='dflash2']
        cells.append(f"{n:,.0f} ({m[0]/n:.2f}x / {d[0]/n:.2f}x)" if m and d else f"{n:,.0f}")
    print(f"| {name} | "+" | ".join(cells)+" |")
# bench moe legs (bench-moe.json for the defaults, bench-moe-ab<i>.json): experts us per
# routing and M <= 64, one column per leg, then the legs' sums over those rows.
moe=[(n,f) for n,f in [('defaults','bench-moe.json')]+[(legs[i][0],f'bench-moe-ab{i}.json') for i in range(1,len(legs))] if os.path.exists(os.path.join(D,f))]
if moe:
    R=[{(x['routing'],x['m']):x for x in json.load(open(os.path.join(D,f)))['rows']} for _,f in moe]
    print('\n| routing | M | '+' | '.join(n for n,_ in moe)+' |')
    keys=[k for k in R[0] if k[1]<=64]
    for k in keys:
        print(f"| {k[0]} | {k[1]} | "+' | '.join(f"{r[k]['experts_us']:.1f} ({100*r[k]['frac_copy']:.0f}%)" if k in r else '-' for r in R)+' |')
    print('| sum | <=64 | '+' | '.join(f"{sum(r[k]['experts_us'] for k in keys if k in r):.0f}" for r in R)+' |')
