// The target that builds the tests' precompiled header (Note [Test build
// time] in tests/CMakeLists.txt); it has no code of its own.
