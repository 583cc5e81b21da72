export MAX_JOBS=16 PYTHONPATH=$PWD CS149GPT_CUDA_ARCHS=90a
python3 -c "import cs149gpt; print(cs149gpt.isa())" 2>&1 | tail -1
timeout 330 python3 -m pytest -q -p no:cacheprovider -n 6 tests --ignore=tests/test_cuda.py --ignore=tests/test_cuda_compile.py > $OUT/pytest_cpu_all.txt 2>&1; echo "cpu pytest rc=$?"; tail -2 $OUT/pytest_cpu_all.txt; grep -E "^FAILED|crashed|Fatal" $OUT/pytest_cpu_all.txt | head -20
timeout 170 python3 -m pytest tests/test_cuda.py -q -n 4 -p no:cacheprovider > $OUT/pytest_cuda.txt 2>&1; echo "cuda pytest rc=$?"; tail -2 $OUT/pytest_cuda.txt; grep -E "^FAILED" $OUT/pytest_cuda.txt | head
