from nondet.cli import main

main()
