"""The command line's verbs, one module each: its argparse wiring, `add_parser(sub, verb, summary)`, and its
`main(args) -> int`, which calls the library where it lives (stages/, models/, remote/, engine/, report/, ...) and
turns a mistake into one error line and an exit code. `cli.py` lists the verbs; no package below imports these."""
