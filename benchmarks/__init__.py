"""The lab: studies that measure moejax, grouped in folders by the question they answer, each
run from the repository root as `python -m benchmarks.FOLDER.STUDY --help`, its results in
FOLDER/results/ and a README that says the question, the commands and the decisions it feeds.
The modules here are what every study shares: `common` (start, stamp, write), `timing`,
`turns`, `families` (the registry of result tables) and `render` (the one renderer).
docs/guide/tools-and-benchmarks.md lists every study. Importing any of it runs nothing: a
runnable study fakes its CPU devices in its entry (`common.start`)."""
