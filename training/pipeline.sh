#!/usr/bin/env bash
# The demo pair and its heads, as shipped in tinydraft_mlx/demo/: every command in the order it
# ran, as results/demo_training.json, demo_retrain.json, demo_derepeat.json and
# train_heads.json record them (each writes its weights into tinydraft_mlx/demo/). Run from the
# repository root with the bench extra installed (pip install -e ".[bench]"); ~4 hours on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

# 1. train the pair from scratch
python -m training.train_demo --vocab 4096 --target-steps 900 --draft-steps 700 --batch 16 --seq 256 --seed 0

# 2. retrain it on code, chat and editing exchanges
python -m training.retrain_demo --target-steps 700 --draft-steps 300 --batch 16 --seq 256 --mix 0.4 0.2 0.4 --seed 0

# 3. fine-tune the target against repeating itself, distil the draft on its text
python -m training.derepeat_demo --target-steps 400 --draft-steps 600 --unlikelihood 0.5 --sequence-unlikelihood 1.0 --draft-alpha 0.2 --generated 512 --batch 16 --seq 256 --mix 0.5 0.2 0.3 --seed 0 --prompt-len 32
python -m training.derepeat_demo --target-steps 0 --draft-steps 1200 --unlikelihood 0.5 --sequence-unlikelihood 1.0 --draft-alpha 0.1 --generated 1024 --batch 16 --seq 256 --mix 0.5 0.2 0.3 --seed 0 --prompt-len 128 --resume
python -m training.derepeat_demo --target-steps 0 --draft-steps 1500 --unlikelihood 0.5 --sequence-unlikelihood 1.0 --draft-alpha 0.0 --generated 2048 --batch 16 --seq 256 --mix 0.5 0.2 0.3 --seed 1 --prompt-len 128 --resume

# 4. train the heads that read the target (MTP layer, EAGLE-3 head) on its own text
python -m training.train_heads --steps 1500 --batch 16 --seq 128 --lr 0.002 --generated 0 --head mtp
python -m training.train_heads --steps 2500 --batch 16 --seq 128 --lr 0.002 --generated 1024 --prompt-len 128 --seed 0 --head mtp --resume
python -m training.train_heads --steps 3000 --batch 16 --seq 128 --lr 0.002 --generated 2048 --own-share 0.75 --prompt-len 128 --seed 1 --head mtp --resume
python -m training.train_heads --steps 1000 --batch 16 --seq 128 --lr 0.002 --generated 0 --head eagle3
python -m training.train_heads --steps 1500 --batch 16 --seq 128 --lr 0.002 --generated 1024 --prompt-len 128 --seed 0 --head eagle3 --resume
python -m training.train_heads --steps 1500 --batch 16 --seq 128 --lr 0.002 --generated 2048 --own-share 0.75 --prompt-len 128 --seed 1 --head eagle3 --resume

# 5. train the DFlash block drafter on the target's states and its own text
python -m training.train_dflash --steps 3000 --batch 16 --seq 96 --lr 0.0003 --layers 2 --block-size 16 --generated 256 --own-share 0.5 --seed 0
python -m training.train_dflash --steps 2000 --batch 16 --seq 96 --lr 0.0005 --layers 2 --block-size 16 --generated 256 --own-share 0.5 --seed 0 --decay 3.0 --resume
