from nondet.entry import main

main()
