"""Run `tfserve serve ...` with a main-thread profiler SIGUSR1 starts and SIGUSR2 stops and dumps to $PROF."""
import cProfile, os, signal, sys
prof = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *a: prof.enable())
def stop(*a):
    prof.disable(); prof.dump_stats(os.environ["PROF"])
signal.signal(signal.SIGUSR2, stop)
from tfserve.cli import main as app
sys.argv = ["tfserve", *sys.argv[1:]]
app()
